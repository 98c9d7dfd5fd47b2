"""``gvisor``: a sandbox under gVisor's user-space kernel (``runsc``), driven
directly with OCI bundles hutch makes from its images (see :mod:`.sandbox`)."""

from .sandbox import GvisorConfig, GvisorSandbox

__all__ = ["GvisorConfig", "GvisorSandbox"]
