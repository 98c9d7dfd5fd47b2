"""A terminal: an interactive command on a pseudo-terminal, over a websocket."""

from __future__ import annotations

import contextlib
import json

import anyio
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ..._errors import HutchError, InvalidArgument
from ..bodies import PtyStart, pty_resize
from ..errors import error_json
from . import DaemonGetter, v1_router


def router(daemon: DaemonGetter) -> APIRouter:
    v1 = v1_router()

    @v1.websocket("/sandboxes/{sandbox_id}/pty")
    async def pty(websocket: WebSocket, sandbox_id: str) -> None:
        """An interactive command (a shell by default) on a pseudo-terminal
        (``hutch shell``, ``Sandbox.pty`` through the SDK).

        The first message is text, :class:`PtyStart` as JSON. Then binary
        messages are bytes: typed ones in, the terminal's out. Text messages
        are JSON: ``{"resize": [rows, cols]}`` in; ``{"exit": code}`` or
        ``{"error": {"code", "message"}}`` out, last, before the close.
        """
        await websocket.accept()
        try:
            try:
                with anyio.fail_after(30):
                    first = await websocket.receive_text()
                start = PtyStart.model_validate_json(first)
            except (ValidationError, TimeoutError, KeyError) as exc:
                raise InvalidArgument(f"a terminal starts with a PtyStart message: {exc}") from None
            sandbox = await daemon().get(sandbox_id)
            async with sandbox.pty(
                start.cmd, rows=start.rows, cols=start.cols, cwd=start.cwd, env=start.env,
                user=start.user,
            ) as proc, anyio.create_task_group() as tg:

                async def typed() -> None:
                    while True:
                        message = await websocket.receive()
                        if message["type"] == "websocket.disconnect":
                            tg.cancel_scope.cancel()
                            return
                        if message.get("bytes"):
                            await proc.write(message["bytes"])
                        elif message.get("text"):
                            size = pty_resize(message["text"])
                            if size is not None:
                                await proc.resize(*size)

                tg.start_soon(typed)
                while (chunk := await proc.read()) is not None:
                    await websocket.send_bytes(chunk.data)
                await websocket.send_text(json.dumps({"exit": await proc.wait()}))
                tg.cancel_scope.cancel()
            await websocket.close()
        except WebSocketDisconnect:
            return
        except HutchError as exc:
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps(error_json(exc)))
                await websocket.close(code=1011)


    return v1
