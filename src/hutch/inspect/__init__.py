"""The ``hutch`` sandbox environment of inspect_ai (``pip install
'hutch[inspect]'``): installing hutch registers it through the ``inspect_ai``
entry point, which loads this module, so ``Task(sandbox="hutch")``,
``Task(sandbox=("hutch", "hutch.toml"))`` and ``inspect eval --sandbox hutch``
work as they are. See :mod:`.environment` for the contract it keeps and
:mod:`.config` for what a task can ask.
"""

from __future__ import annotations

from .config import HutchSandboxConfig
from .environment import HutchSandboxEnvironment

__all__ = ["HutchSandboxConfig", "HutchSandboxEnvironment"]
