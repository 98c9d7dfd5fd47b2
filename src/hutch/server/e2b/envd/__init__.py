"""The in-sandbox API of E2B (envd) over hutch's sandboxes: the Connect
protocol's process and filesystem services, ``/files`` and ``/health``.

:data:`ENVD_VERSION` is what the control plane advertises as a sandbox's
``envdVersion``: the highest whose features this module really implements
(the SDKs gate features on it on their side).
"""

from __future__ import annotations

from .app import EnvdApp

#: 0.3.0: stdin can be asked for or not; 0.4.0: the default user needs no
#: Basic header; 0.5.7: octet-stream (and gzipped) uploads. Not yet 0.5.2
#: (closing a running command's stdin), which 0.5.7 implies on the SDKs' side:
#: see docs in this package's modules for what is left.
ENVD_VERSION = "0.5.7"

__all__ = ["ENVD_VERSION", "EnvdApp"]
