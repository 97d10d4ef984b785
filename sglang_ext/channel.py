"""The control channel's socket: one ZMQ ROUTER, optionally CURVE-authenticated, and the framing of replies.

Every request gets exactly one reply: a reply that cannot be encoded is replaced by an error reply that can, and
a peer that vanished before its reply costs a log line, never the server.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_ext.protocol import ErrorCode, Header, ProtocolError, encode, error_header
from sglang_ext.serve_config import ServeConfig, ServeConfigError, bind_address

log = logging.getLogger(__name__)


class Channel:
    """The ROUTER socket of one server: bind (with CURVE when configured), receive frames, send replies."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.endpoint: str | None = None
        self.sock: Any = None
        self._ctx: Any = None
        self._auth: Any = None

    def bind(self) -> str:
        """Create and bind the socket (before the event loop runs, so a taken port fails fast); the endpoint."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.cfg.curve:
            self._enable_curve(ctx, sock)
        sock.bind(bind_address(self.cfg.control))
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.sock = sock
        return self.endpoint

    def _enable_curve(self, ctx: Any, sock: Any) -> None:
        """Serve CURVE with the configured secret key; only clients in the authorized-keys folder connect."""
        from zmq.auth import load_certificate
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = load_certificate(self.cfg.curve_secret_key)
        if secret is None:
            raise ServeConfigError(f"{self.cfg.curve_secret_key} holds no secret key")
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(self.cfg.curve_authorized_keys))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    async def recv(self) -> list:
        """The next request's frames: the peer's identity first."""
        return await self.sock.recv_multipart(copy=False)

    def send(
        self, identity: bytes, header: Header, arrays: dict | None = None, raw: list | None = None
    ) -> None:
        try:
            frames = encode(header, arrays, raw)
        except Exception as e:  # answered with an error that can be encoded: every request gets one reply
            log.exception("could not encode a %s reply", header.type)
            err = ProtocolError(
                ErrorCode.ENGINE_ERROR,
                f"the reply could not be encoded ({type(e).__name__}); if the request changed state, "
                "stats and fetch show it",
            )
            try:
                frames = encode(error_header(header.id, header.type, err))
            except Exception:
                frames = encode(error_header(None, None, err))
        try:
            self.sock.send_multipart([identity, *frames], copy=False)
        except Exception as e:  # a vanished peer must not stop the server
            log.warning("could not send a %s reply: %s", header.type, e)

    def close(self) -> None:
        self.sock.close(linger=500)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)
