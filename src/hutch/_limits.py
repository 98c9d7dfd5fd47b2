"""The numbers every layer bounds its settings with: output and read caps,
the longest duration, the search timeout, the kill grace. A leaf of plain
constants, apart from :mod:`hutch._types`' data classes, so that the client
(whose method defaults name some of them) loads no class to read them.
"""

from __future__ import annotations

DEFAULT_OUTPUT_LIMIT = 16 * 1024 * 1024
DEFAULT_READ_LIMIT = 256 * 1024 * 1024
# Ceilings on what a caller may ask for: every number hutch takes is finite and
# bounded, so that no request can make the daemon hold more than this.
#: The largest output cap one command may ask for, bytes.
MAX_OUTPUT_LIMIT = 256 * 1024 * 1024
#: The largest file read (and request body) hutch moves at once, bytes.
MAX_READ_LIMIT = DEFAULT_READ_LIMIT
#: The longest duration any setting takes (timeouts, lifetimes), seconds: a year.
MAX_DURATION = 365 * 24 * 3600.0
#: How long a grep or glob may run before it is stopped (``exec_timeout``).
DEFAULT_SEARCH_TIMEOUT = 60.0
#: What a timed-out or killed command gets between SIGTERM and SIGKILL.
KILL_GRACE_SECONDS = 1.0
#: How long hutch's client keeps an idle connection to a daemon for its next
#: call (httpx's own default), seconds.
CLIENT_IDLE_SECONDS = 5.0
#: How long a hutch server (the daemon, a sandbox's ref server, ``hutch mcp``)
#: keeps an idle connection open, seconds: well past its clients' own idle
#: keep (hutch's and httpx's 5 s, Node's 4 s), so that a client never sends a
#: call on a connection the server is closing at that moment. With both at 5 s
#: (uvicorn's default) such a call failed as "not reachable", and a POST cannot
#: be sent again (it may have been done).
SERVER_IDLE_SECONDS = 60
