"""hutch's agent: a small static executable inside the sandbox as its keeper,
serving exec and files on a unix socket (``go/``), the host side of it
(:mod:`.runtime`, its commands in :mod:`.process`, its
watches in :mod:`.watch`, the files it hands over in :mod:`.handover`, its frames
in :mod:`.wire`) and its build (:mod:`.build`)."""

from .build import AgentUnavailable, agent_binary
from .process import AgentProcess
from .runtime import AgentRuntime
from .wire import AgentFailure

__all__ = ["AgentFailure", "AgentProcess", "AgentRuntime", "AgentUnavailable", "agent_binary"]
