"""The ``bubblewrap`` provider: namespaces, an overlay, cgroups (see .sandbox)."""

from .sandbox import BubblewrapConfig, BubblewrapSandbox

__all__ = ["BubblewrapConfig", "BubblewrapSandbox"]
