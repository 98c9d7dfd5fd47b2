"""``kubernetes``: a sandbox is a Pod, reached through the API server."""

from .sandbox import KubernetesSandbox

__all__ = ["KubernetesSandbox"]
