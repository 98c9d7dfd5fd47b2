"""The ``e2b`` provider: sandboxes on E2B's service through the ``e2b`` SDK
(``pip install 'hutch[e2b]'``)."""

from .config import E2BConfig
from .sandbox import E2BSandbox

__all__ = ["E2BConfig", "E2BSandbox"]
