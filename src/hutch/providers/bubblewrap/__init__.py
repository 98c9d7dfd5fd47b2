"""The ``bubblewrap`` provider: namespaces, an overlay, cgroups (see .sandbox)."""

from .config import BubblewrapConfig
from .sandbox import BubblewrapSandbox

__all__ = ["BubblewrapConfig", "BubblewrapSandbox"]
