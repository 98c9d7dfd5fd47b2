"""The connections a daemon keeps to the other daemons of its fleet, for
forwarding (:mod:`.forward`).

aiohttp's client: its parser is C (llhttp), it takes the request's head as
it came and its body as bytes or a stream, and hands the answer's raw head
and body back undecoded; per forwarded call it costs about half what httpx
or httpcore (pure-Python h11 under both) did. Imported on the first
forwarded call: a daemon alone never loads it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp


class PeerUnreachable(Exception):
    """The owner could not be reached (or its connection broke first)."""


class Peers:
    """Kept connections to the fleet's other daemons, made on first use."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                # aiohttp sets TCP_NODELAY on its connections: a request goes
                # at once, not a delayed ACK (40 ms) later.
                connector=aiohttp.TCPConnector(limit=512, limit_per_host=0),
                # The answer goes back as the owner made it (compressed or not).
                auto_decompress=False,
                # The fleet's daemons reach each other directly, never through a proxy.
                trust_env=False,
                # Nothing but what the client sent (and the body's framing).
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                # No limit to read: an exec may run for hours.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
            )
        return self._session

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes] | None,
    ) -> aiohttp.ClientResponse:
        """The owner's answer, its body still to read (``content``); the
        caller releases it. ``url``: already encoded, taken as it is."""
        import aiohttp
        import yarl

        try:
            return await self._client().request(
                method, yarl.URL(url, encoded=True), headers=headers, data=body,
                allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PeerUnreachable(repr(exc)) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
