"""Requests to handlers: decoding, the op table, the command worker and error replies.

Commands (every type not in `protocol.QUERY_TYPES`) run one at a time in arrival order on one worker; queries
run beside them at once. A handler validates its whole request before it changes any state, so a refused request
(a `ProtocolError`, answered with its code) changes nothing; any other exception is answered as `ENGINE_ERROR`
and the server keeps serving.

The op table is filled by op groups (see `sglang_ext.handlers`): each message type the protocol defines
(`protocol.BODIES`) has exactly one handler, checked when the server is built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from sglang_ext.channel import Channel
from sglang_ext.protocol import (
    BODIES,
    PROTOCOL_VERSION,
    QUERY_TYPES,
    ErrorCode,
    Header,
    Message,
    ProtocolError,
    check_buffer_names,
    decode,
    error_header,
    parse_body,
)

log = logging.getLogger(__name__)

# a handler's reply: body, named numpy buffers (encoded by protocol.encode), raw frames
Reply = tuple[dict[str, Any], dict[str, Any] | None, list | None]
# a handler takes the parsed body (the type's model in protocol.BODIES) and the whole message (its buffers)
Handler = Callable[[Any, Message], Awaitable[Reply]]


class OpGroup(Protocol):
    """A group of handlers (see `sglang_ext.handlers`): its handlers by message type."""

    def handlers(self) -> Mapping[str, Handler]: ...


class Dispatcher:
    """Routes each request to its handler and answers it exactly once."""

    def __init__(
        self,
        channel: Channel,
        spawn: Callable[[Awaitable[Any]], asyncio.Task],
        stopping: Callable[[], bool],
    ):
        self.channel = channel
        self._spawn = spawn
        self._stopping = stopping
        self.handlers: dict[str, Handler] = {}
        self._commands: asyncio.Queue = asyncio.Queue()

    def register(self, handlers: Mapping[str, Handler]) -> None:
        """Add an op group's handlers; a type the protocol does not define, or one already handled, is refused."""
        for typ, handler in handlers.items():
            if typ not in BODIES:
                raise ValueError(f"op {typ!r} has no body schema in sglang_ext.protocol.BODIES")
            if typ in self.handlers:
                raise ValueError(f"op {typ!r} is registered twice")
            self.handlers[typ] = handler

    def check_complete(self) -> None:
        missing = sorted(set(BODIES) - set(self.handlers))
        if missing:
            raise ValueError(f"no handler registered for message type(s) {missing}")

    def queued(self) -> int:
        """Commands waiting for the worker."""
        return self._commands.qsize()

    def on_frames(self, frames: list) -> None:
        """Decode one request and queue it (a command) or start it (a query); an unreadable one is answered."""
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:], request=True)
        except ProtocolError as e:
            self.channel.send(identity, error_header(e.req_id, e.req_type, e))
            return
        except Exception as e:  # a parser fault must cost one error reply, never the server
            log.exception("decoding a request failed")
            err = ProtocolError(ErrorCode.MALFORMED, f"unreadable request: {type(e).__name__}")
            self.channel.send(identity, error_header(None, None, err))
            return
        typ = msg.header.type
        if typ not in BODIES:  # at most MAX_TYPE_CHARS (decode refuses longer), so echoed whole
            err = ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {typ!r}; known: {sorted(BODIES)}")
            self.channel.send(identity, error_header(msg.header.id, typ, err))
            return
        received = (time.perf_counter(), time.time())
        if typ in QUERY_TYPES:
            self._spawn(self._execute(identity, msg, received))
        else:
            self._commands.put_nowait((identity, msg, received))

    async def command_worker(self) -> None:
        while True:
            identity, msg, received = await self._commands.get()
            try:
                await self._execute(identity, msg, received)
            except Exception:  # _execute answers every failure itself; this worker must outlive anything
                log.exception("command %s escaped its error handling", msg.header.type)

    async def _execute(self, identity: bytes, msg: Message, received: tuple[float, float]) -> None:
        typ = msg.header.type
        try:
            if self._stopping() and typ != "health":
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            body = parse_body(BODIES[typ], msg.body, typ)
            check_buffer_names(typ, msg)
            reply_body, arrays, raw = await self.handlers[typ](body, msg)
            reply_body["handled_s"] = time.perf_counter() - received[0]  # arrival to reply, queueing included
            # wall-clock stamps: with the client's own, they split a call's latency into its two hops
            reply_body["received_at"], reply_body["sent_at"] = received[1], time.time()
            header = Header(proto=PROTOCOL_VERSION, id=msg.header.id, type=typ, ok=True, body=reply_body)
            self.channel.send(identity, header, arrays, raw)
        except ProtocolError as e:
            self.channel.send(identity, error_header(msg.header.id, typ, e))
        except Exception as e:
            log.exception("%s failed", typ)
            err = ProtocolError(
                ErrorCode.ENGINE_ERROR, f"{typ} failed in the server: {type(e).__name__}: {e}"
            )
            self.channel.send(identity, error_header(msg.header.id, typ, err))
