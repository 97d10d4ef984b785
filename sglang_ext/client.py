"""Controller side of the control channel: `ServerConnection` speaks the protocol to one server.

Requests and replies are matched by id, several may be in flight, bytes are counted per message type; typed
operations encode their bodies and decode output batches (`OutputBatch`, columnar). The loop's rollout engine
(`sglang_ext.rollout_engine`) routes over one connection per server; tests and tools use a connection alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sglang_ext.protocol import (
    PROTOCOL_VERSION,
    BufferSpec,
    Header,
    Message,
    OutputBatch,
    ProtocolError,
    WireSamplingParams,
    concat,
    decode,
    encode,
)

log = logging.getLogger("sglang_ext.client")


class ControlError(Exception):
    """An error reply (or no reply) from a server; `code` is a protocol ErrorCode or UNAVAILABLE."""

    def __init__(self, code: str, message: str, endpoint: str = "", details: dict | None = None):
        super().__init__(f"{endpoint + ': ' if endpoint else ''}{code}: {message}")
        self.code = code
        self.message = message
        self.endpoint = endpoint
        self.details = details or {}


UNAVAILABLE = "UNAVAILABLE"


@dataclass
class CurveKeys:
    """Client side of CURVE: the server's public key and this client's certificate (public + secret)."""

    server_public_key: bytes
    client_public_key: bytes
    client_secret_key: bytes

    @classmethod
    def from_files(cls, server_cert: str | Path, client_secret_cert: str | Path) -> CurveKeys:
        from zmq.auth import load_certificate

        server_public, _ = load_certificate(str(server_cert))
        public, secret = load_certificate(str(client_secret_cert))
        if secret is None:
            raise ValueError(f"{client_secret_cert} holds no secret key")
        return cls(server_public, public, secret)


def tensor_frame(name: str, tensor: Any) -> tuple[BufferSpec, memoryview]:
    """A weight tensor as a raw frame (any float dtype torch has, bfloat16 included), without a copy when
    it is already contiguous on the CPU."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return BufferSpec(name=name, dtype=dtype, shape=list(t.shape)), memoryview(raw)


class ServerConnection:
    """One server: a DEALER socket, one reply per request matched by id, several requests in flight."""

    def __init__(self, endpoint: str, *, curve: CurveKeys | None = None, timeout_s: float = 300.0, ctx=None):
        self.endpoint = endpoint
        self.curve = curve
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._own_ctx = ctx is None
        self.sock = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.bytes_out: dict[str, int] = {}
        self.bytes_in: dict[str, int] = {}

    async def start(self) -> ServerConnection:
        import zmq
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public_key
            sock.curve_publickey = self.curve.client_public_key
            sock.curve_secretkey = self.curve.client_secret_key
        sock.connect(self.endpoint)
        self.sock = sock
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ControlError(UNAVAILABLE, "connection closed", self.endpoint))
        self._pending.clear()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames)
            except ProtocolError as e:
                log.error("%s: unreadable reply: %s", self.endpoint, e)
                continue
            typ = msg.header.type or "?"
            self.bytes_in[typ] = self.bytes_in.get(typ, 0) + sum(len(f) for f in frames)
            fut = self._pending.pop(msg.header.id, None) if isinstance(msg.header.id, int) else None
            if fut is None:
                log.warning(
                    "%s: reply to no pending request: %s", self.endpoint, msg.header.error or msg.header.type
                )
            elif not fut.done():
                fut.set_result(msg)

    async def call(
        self,
        typ: str,
        body: dict | None = None,
        arrays: dict[str, np.ndarray] | None = None,
        raw: list | None = None,
        timeout_s: float | None = None,
    ) -> Message:
        """Send one request and wait for its reply; raise ControlError for an error reply or a timeout."""
        if self.sock is None:
            raise ControlError(UNAVAILABLE, f"{typ}: the connection is closed", self.endpoint)
        rid = next(self._ids)
        frames = encode(Header(proto=PROTOCOL_VERSION, id=rid, type=typ, body=body or {}), arrays, raw)
        self.bytes_out[typ] = self.bytes_out.get(typ, 0) + sum(memoryview(f).nbytes for f in frames)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        limit = timeout_s or self.timeout_s
        try:
            # a DEALER without a connected peer (server down, CURVE handshake refused) blocks on send
            sent_at = time.time()
            await asyncio.wait_for(self.sock.send_multipart(frames, copy=False), limit)
            msg = await asyncio.wait_for(fut, limit)
            if "sent_at" in msg.header.body:  # request and reply transit, queueing in either process included
                msg.header.body["hops_s"] = (msg.header.body["received_at"] - sent_at,
                                             time.time() - msg.header.body["sent_at"])
        except TimeoutError:
            self._pending.pop(rid, None)
            raise ControlError(
                UNAVAILABLE, f"no reply to {typ} within {timeout_s or self.timeout_s:.0f} s", self.endpoint
            ) from None
        if not msg.header.ok:
            err = msg.header.error or {}
            raise ControlError(
                err.get("code", "?"), err.get("message", ""), self.endpoint, err.get("details")
            )
        return msg

    # typed operations -------------------------------------------------------------------------------

    async def submit(
        self,
        requests: Sequence[SubmitRequest],
        sampling: WireSamplingParams | dict | None = None,
        expect_version: int | None = None,
    ) -> dict:
        body, arrays = _encode_submit(requests, sampling, expect_version)
        return (await self.call("submit", body, arrays)).body

    async def pause(self) -> tuple[OutputBatch, dict]:
        msg = await self.call("pause")
        t0 = time.perf_counter()
        batch = OutputBatch.decode(msg)
        msg.body["client_decode_s"] = time.perf_counter() - t0
        return batch, msg.body

    async def resume(self, hold: Sequence[str] = (), rids: Sequence[str] | None = None) -> dict:
        """Resume the paused server, every paused response but `hold` launching; or, with `rids`, launch
        those held responses of the running server."""
        body: dict[str, Any] = {}
        if rids is not None:
            body["rids"] = list(rids)
        elif hold:
            body["hold"] = list(hold)
        return (await self.call("resume", body)).body

    async def truncate(self, keep: dict[str, int]) -> dict:
        return (await self.call("truncate", {"keep": {k: int(v) for k, v in keep.items()}})).body

    async def append(self, tokens: dict[str, Sequence[int] | np.ndarray], launch: bool = True) -> dict:
        """Append environment tokens (rid -> ids) to responses that are not generating and continue them."""
        items = [{"rid": rid, "count": len(ids)} for rid, ids in tokens.items()]
        flat = concat([np.asarray(ids, np.int32) for ids in tokens.values()], np.int32)
        return (await self.call("append", {"items": items, "launch": launch}, {"token_ids": flat})).body

    async def drop(self, rids: Sequence[str] | None = None, all: bool = False) -> dict:
        body: dict[str, Any] = {"all": True} if all else {"rids": list(rids or [])}
        return (await self.call("drop", body)).body

    async def fetch(self, rids: Sequence[str] | None = None) -> tuple[OutputBatch, dict]:
        msg = await self.call("fetch", {} if rids is None else {"rids": list(rids)})
        return OutputBatch.decode(msg), msg.body

    async def events(
        self, after: int, wait_s: float = 0.0, max_events: int = 4096
    ) -> tuple[OutputBatch, int]:
        msg = await self.call(
            "events",
            {"after": after, "wait_s": wait_s, "max_events": max_events},
            timeout_s=wait_s + self.timeout_s,
        )
        return OutputBatch.decode(msg), int(msg.body["last_seq"])

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]], version: int, bucket: int = 0, commit: bool = True
    ) -> dict:
        raw = [tensor_frame(n, t) for n, t in named_tensors]
        body = {"version": int(version), "bucket": bucket, "commit": commit}
        return (await self.call("update_weights", body, raw=raw)).body

    async def update_weights_from_disk(self, path: str | Path, version: int) -> dict:
        return (
            await self.call("update_weights_from_disk", {"path": str(path), "version": int(version)})
        ).body

    async def flush(self) -> dict:
        return (await self.call("flush")).body

    async def compute_logprobs(
        self, rids: Sequence[str], expect_version: int | None = None
    ) -> tuple[list[np.ndarray], dict]:
        """Each response's log-probs under the served weights (one float32 array per id, in order) and the
        reply body (`version`, `tokens`, `engine_s`)."""
        body: dict[str, Any] = {"rids": list(rids)}
        if expect_version is not None:
            body["expect_version"] = int(expect_version)
        msg = await self.call("compute_logprobs", body)
        counts = msg.array("counts", ["int32"], 1)
        flat = msg.array("logprobs", ["float32"], 1)
        if len(counts) != len(rids) or int(counts.sum()) != len(flat):
            raise ControlError("MALFORMED", "compute_logprobs: the reply's buffers do not match the ids", self.endpoint)
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        flat = flat.copy()  # the frame belongs to the socket
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)], msg.body

    async def stats(self, engine: bool = False) -> dict:
        return (await self.call("stats", {"engine": engine})).body

    async def health(self, timeout_s: float | None = None) -> dict:
        return (await self.call("health", timeout_s=timeout_s)).body

    async def weights(self) -> list[dict]:
        """Every tensor of the served checkpoint: `{name, shape, dtype}`."""
        return (await self.call("weights")).body["weights"]

    async def shutdown(self) -> dict:
        return (await self.call("shutdown")).body


@dataclass
class SubmitRequest:
    """A response to generate: prompt plus an optional kept prefix (with what the controller knows of it)."""

    rid: str
    prompt_ids: Sequence[int] | np.ndarray
    max_new_tokens: int  # budget of the whole response, prefix included
    prefix_ids: Sequence[int] | np.ndarray = ()
    prefix_logprobs: np.ndarray | None = None
    prefix_versions: np.ndarray | None = None
    prefix_routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    sampling: WireSamplingParams | dict | None = None
    group: str | None = None  # responses of one group go to one server


def _sampling(s: WireSamplingParams | dict | None) -> WireSamplingParams | None:
    if s is None or isinstance(s, WireSamplingParams):
        return s
    return WireSamplingParams.model_validate(s)


def _encode_submit(requests: Sequence[SubmitRequest], sampling, expect_version) -> tuple[dict, dict]:
    items = []
    for r in requests:
        it: dict[str, Any] = {
            "rid": r.rid,
            "prompt_len": len(r.prompt_ids),
            "prefix_len": len(r.prefix_ids),
            "max_new_tokens": int(r.max_new_tokens),
        }
        if r.sampling is not None:
            it["sampling"] = _sampling(r.sampling).model_dump(exclude_none=True)
        items.append(it)
    body: dict[str, Any] = {"items": items}
    if sampling is not None:
        body["sampling"] = _sampling(sampling).model_dump(exclude_none=True)
    if expect_version is not None:
        body["expect_version"] = int(expect_version)
    arrays: dict[str, np.ndarray] = {
        "prompt_ids": concat([np.asarray(r.prompt_ids, np.int32) for r in requests], np.int32),
        "prefix_ids": concat([np.asarray(r.prefix_ids, np.int32) for r in requests], np.int32),
    }
    for key, dtype in (("prefix_logprobs", np.float32), ("prefix_versions", np.int32)):
        vals = [getattr(r, key) for r in requests]
        if any(v is not None for v in vals):
            arrays[key] = concat(
                [
                    np.asarray(v, dtype)
                    if v is not None
                    else np.full(len(r.prefix_ids), np.nan if dtype is np.float32 else -1, dtype)
                    for v, r in zip(vals, requests, strict=True)
                ],
                dtype,
            )
    for key in ("prefix_routed_experts", "prompt_routed_experts"):
        vals = [getattr(r, key) for r in requests]
        if all(v is not None for v in vals) and vals:
            arrays[key] = np.concatenate(vals)
    return body, arrays
