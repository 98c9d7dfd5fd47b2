"""What hutch's E2B wire says of itself to the SDKs."""

from __future__ import annotations

#: The envd version create and connect advertise: the highest whose features
#: the in-sandbox API (:mod:`.envd`) really implements. The SDKs gate calls on
#: it (e2b/envd/versions.py): 0.3.0 ``stdin=False``, 0.4.0 the default user,
#: 0.5.2 ``close_stdin``, 0.5.7 octet-stream uploads, 0.6.2 file metadata.
ENVD_VERSION = "0.5.7"

#: The port the SDKs name for the in-sandbox API (``E2b-Sandbox-Port``).
ENVD_PORT = 49983

#: What ``clientID`` says (E2B's is the cluster node; the SDKs only carry it).
CLIENT_ID = "hutch"

#: E2B's default sandbox lifetime when create names no timeout, seconds.
DEFAULT_TIMEOUT = 300
