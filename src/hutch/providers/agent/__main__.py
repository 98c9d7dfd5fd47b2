"""``python -m hutch.providers.agent``: build the agent (if its source changed)
and print where the executable is."""

from .build import agent_binary

print(agent_binary())
