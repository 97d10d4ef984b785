"""Controller side of the control channel: an asyncio client for one or several rollout servers.

`ServerConnection` speaks the protocol to one server (request/reply matched by id, byte counters).
`RolloutClient` is the rollout-engine interface the loop uses: it spreads responses over servers (a GRPO group
stays on one server, so its shared prompt hits the prefix cache), mirrors every response's accumulated output
(so a crashed server loses only what it generated since the last pause: `recover()` resubmits the rest
elsewhere), streams finished responses, and fans pause/truncate/resume/weight updates out to every server.
`SyncRolloutClient` runs it on a private event loop for synchronous callers; `WeightSink` is the trainer's
end of weight updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sglang_ext.protocol import (
    PROTOCOL_VERSION,
    BufferSpec,
    ErrorCode,
    Header,
    Message,
    Output,
    ProtocolError,
    SamplingParams,
    decode,
    decode_outputs,
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
DETACHED = -1  # TrackedResponse.server of a finished response whose server was lost
EVENTS_PER_POLL = 4096


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
            await self.start()
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
        sampling: SamplingParams | dict | None = None,
        expect_version: int | None = None,
    ) -> dict:
        body, arrays = _encode_submit(requests, sampling, expect_version)
        return (await self.call("submit", body, arrays)).body

    async def pause(self) -> tuple[list[Output], dict]:
        msg = await self.call("pause")
        t0 = time.perf_counter()
        outs = decode_outputs(msg)
        msg.body["client_decode_s"] = time.perf_counter() - t0
        return outs, msg.body

    async def resume(self) -> dict:
        return (await self.call("resume")).body

    async def truncate(self, keep: dict[str, int]) -> dict:
        return (await self.call("truncate", {"keep": {k: int(v) for k, v in keep.items()}})).body

    async def drop(self, rids: Sequence[str] | None = None, all: bool = False) -> dict:
        body: dict[str, Any] = {"all": True} if all else {"rids": list(rids or [])}
        return (await self.call("drop", body)).body

    async def fetch(self, rids: Sequence[str] | None = None) -> tuple[list[Output], dict]:
        msg = await self.call("fetch", {} if rids is None else {"rids": list(rids)})
        return decode_outputs(msg), msg.body

    async def events(
        self, after: int, wait_s: float = 0.0, max_events: int = 4096
    ) -> tuple[list[Output], int]:
        msg = await self.call(
            "events",
            {"after": after, "wait_s": wait_s, "max_events": max_events},
            timeout_s=wait_s + self.timeout_s,
        )
        return decode_outputs(msg), int(msg.body["last_seq"])

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
    sampling: SamplingParams | dict | None = None
    group: str | None = None  # responses of one group go to one server


def _sampling(s: SamplingParams | dict | None) -> SamplingParams | None:
    if s is None or isinstance(s, SamplingParams):
        return s
    return SamplingParams.model_validate(s)


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
        "prompt_ids": _cat([np.asarray(r.prompt_ids, np.int32) for r in requests], np.int32),
        "prefix_ids": _cat([np.asarray(r.prefix_ids, np.int32) for r in requests], np.int32),
    }
    for key, dtype in (("prefix_logprobs", np.float32), ("prefix_versions", np.int32)):
        vals = [getattr(r, key) for r in requests]
        if any(v is not None for v in vals):
            arrays[key] = _cat(
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


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


# ---------------------------------------------------------------------------------------------- tracking


@dataclass
class TrackedResponse:
    """The controller's copy of one response: everything it was submitted with plus every delta received."""

    rid: str
    prompt_ids: np.ndarray
    max_new_tokens: int
    sampling: SamplingParams | None
    group: str | None
    server: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_budget(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    def apply(self, out: Output) -> None:
        """Append a delta; its offset must be where this copy ends (truncation keeps both sides aligned)."""
        n = len(self.token_ids)
        if out.offset != n:
            raise ControlError(
                "OUT_OF_SYNC",
                f"response {self.rid}: delta starts at {out.offset} but the controller holds {n} tokens",
            )
        if n == 0:  # the delta's arrays are already this client's own copies
            self.token_ids, self.logprobs, self.versions = out.token_ids, out.logprobs, out.versions
        else:
            self.token_ids = np.concatenate([self.token_ids, out.token_ids])
            self.logprobs = np.concatenate([self.logprobs, out.logprobs])
            self.versions = np.concatenate([self.versions, out.versions])
        if out.routed_experts is not None:
            if self.routed_experts is None or n == 0:
                self.routed_experts = out.routed_experts
            else:
                self.routed_experts = np.concatenate([self.routed_experts, out.routed_experts])
        if out.prompt_routed_experts is not None and self.prompt_routed_experts is None:
            self.prompt_routed_experts = out.prompt_routed_experts
        self.finish_reason = out.finish_reason
        self.error = out.error

    def truncate(self, keep: int) -> None:
        """Cut to the first `keep` tokens; a finished response cut short is live again (as on the server)."""
        if keep < len(self.token_ids):
            self.finish_reason = self.error = None
        self.token_ids = self.token_ids[:keep]
        self.logprobs = self.logprobs[:keep]
        self.versions = self.versions[:keep]
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts[:keep]

    def as_submit(self) -> SubmitRequest:
        """Resubmission of this response from what the controller holds (after its server died)."""
        return SubmitRequest(
            rid=self.rid,
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            prefix_ids=self.token_ids,
            prefix_logprobs=self.logprobs,
            prefix_versions=self.versions,
            prefix_routed_experts=self.routed_experts
            if (self.routed_experts is not None and len(self.routed_experts) == len(self.token_ids))
            else None,
            prompt_routed_experts=self.prompt_routed_experts,
            sampling=self.sampling,
            group=self.group,
        )


@dataclass
class ServerState:
    conn: ServerConnection
    index: int
    alive: bool = True
    last_seq: int = 0
    version: int | None = None
    paused: bool = False
    rids: set[str] = field(default_factory=set)
    live: int = 0
    poller: asyncio.Task | None = None
    seq_cond: asyncio.Condition = field(default_factory=asyncio.Condition)


class RolloutClient:
    """The rollout-engine interface of the loop, over one or several servers."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        curve: CurveKeys | Sequence[CurveKeys | None] | None = None,
        timeout_s: float = 300.0,
        poll_wait_s: float = 1.0,
    ):
        curves = list(curve) if isinstance(curve, list | tuple) else [curve] * len(endpoints)
        self.servers = [
            ServerState(ServerConnection(ep, curve=c, timeout_s=timeout_s), i)
            for i, (ep, c) in enumerate(zip(endpoints, curves, strict=True))
        ]
        self.poll_wait_s = poll_wait_s
        self.responses: dict[str, TrackedResponse] = {}
        self._finished: asyncio.Queue[Output | None] = asyncio.Queue()
        self.on_finished: Callable[[Output], None] | None = None
        self.failure: BaseException | None = None  # set when event delivery broke (raised by later calls)
        self.last_pause: list[dict] = []  # each server's pause reply body (timings: engine_s, server_s)
        self._unreported: dict[str, Output] = {}  # pause deltas not yet returned (another server failed)
        self._started = False

    async def start(self, health_timeout_s: float = 30.0) -> RolloutClient:
        """Connect, read each server's version and paused state, start the event pollers."""
        for s in self.servers:
            await s.conn.start()
        infos = await asyncio.gather(*(s.conn.health(timeout_s=health_timeout_s) for s in self.servers))
        for s, info in zip(self.servers, infos, strict=True):
            s.version, s.paused = info["version"], info["paused"]
            s.poller = asyncio.ensure_future(self._poll(s))
        self._started = True
        return self

    async def __aenter__(self) -> RolloutClient:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for s in self.servers:
            await self._stop_poller(s)
            await s.conn.close()

    async def _stop_poller(self, s: ServerState) -> None:
        """Cancel a server's event poller and wait until it has ended. Cancel again until it does: Python
        3.11's `asyncio.wait_for` can swallow a cancellation that races with a reply (a close hung on it)."""
        task, s.poller = s.poller, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.debug("poller of %s ended with %r", s.conn.endpoint, task.exception())

    def _alive(self) -> list[ServerState]:
        alive = [s for s in self.servers if s.alive]
        if not alive:
            raise ControlError(UNAVAILABLE, "no rollout server is alive")
        return alive

    async def _poll(self, s: ServerState) -> None:
        """Deliver finished responses of one server in sequence order; acknowledges by polling past them."""
        try:
            while s.alive:
                try:
                    outs, server_seq = await s.conn.events(
                        after=s.last_seq, wait_s=self.poll_wait_s, max_events=EVENTS_PER_POLL
                    )
                except ControlError as e:
                    if e.code not in (UNAVAILABLE, ErrorCode.SHUTTING_DOWN):
                        raise
                    log.error("server %s is gone: %s", s.conn.endpoint, e)  # crashed, or stopped by someone
                    s.alive = False
                    break
                for out in outs:
                    if out.seq is None or out.seq <= s.last_seq:
                        continue
                    tr = self.responses.get(out.rid)
                    if tr is not None and tr.server == s.index:
                        tr.apply(out)
                        s.live -= 1
                        self._finished.put_nowait(out)
                        if self.on_finished is not None:
                            self.on_finished(out)
                    async with s.seq_cond:
                        s.last_seq = out.seq
                        s.seq_cond.notify_all()
                if len(outs) < EVENTS_PER_POLL and server_seq > s.last_seq:
                    # every pending event was in this reply: the rest up to server_seq were acknowledged
                    # before (another client, an earlier connection), so nothing older is still owed to us
                    async with s.seq_cond:
                        s.last_seq = server_seq
                        s.seq_cond.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surface it to whoever waits, instead of a silent stall
            log.exception("event delivery from %s failed", s.conn.endpoint)
            self.failure = e
            self._finished.put_nowait(None)  # wake next_finished
        finally:
            async with s.seq_cond:
                s.seq_cond.notify_all()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise ControlError("CLIENT_FAILED", f"event delivery failed: {self.failure!r}") from self.failure

    async def _await_seq(self, s: ServerState, seq: int) -> None:
        async with s.seq_cond:
            await s.seq_cond.wait_for(lambda: s.last_seq >= seq or not s.alive or self.failure is not None)
        self._raise_failure()

    # ------------------------------------------------------------------------------------- operations

    async def submit(
        self,
        requests: Sequence[SubmitRequest],
        sampling: SamplingParams | dict | None = None,
        expect_version: int | None = None,
    ) -> None:
        """Spread requests over alive servers (whole groups to the least-loaded one); all-or-nothing per server."""
        dup = [r.rid for r in requests if r.rid in self.responses]
        if dup:
            raise ControlError(ErrorCode.DUPLICATE_RESPONSE, f"response id(s) already tracked: {dup[:10]}")
        groups: dict[str, list[SubmitRequest]] = {}
        for r in requests:
            groups.setdefault(r.group if r.group is not None else f"\0{r.rid}", []).append(r)
        alive = self._alive()
        load = {s.index: s.live for s in alive}
        plan: dict[int, list[SubmitRequest]] = {}
        for members in groups.values():
            target = min(load, key=lambda i: (load[i], i))
            plan.setdefault(target, []).extend(members)
            load[target] += len(members)
        samp = _sampling(sampling)

        async def one(idx: int, reqs: list[SubmitRequest]) -> None:
            s = self.servers[idx]
            await s.conn.submit(reqs, samp, expect_version)
            for r in reqs:
                self.responses[r.rid] = self._track(r, idx, samp)
                s.rids.add(r.rid)
            s.live += len(reqs)

        await asyncio.gather(*(one(i, reqs) for i, reqs in plan.items()))

    def _track(self, r: SubmitRequest, server: int, sampling: SamplingParams | None) -> TrackedResponse:
        n = len(r.prefix_ids)
        return TrackedResponse(
            rid=r.rid,
            prompt_ids=np.asarray(r.prompt_ids, np.int32),
            max_new_tokens=r.max_new_tokens,
            sampling=_sampling(r.sampling) or sampling,
            group=r.group,
            server=server,
            token_ids=np.asarray(r.prefix_ids, np.int32),
            logprobs=np.asarray(r.prefix_logprobs, np.float32)
            if r.prefix_logprobs is not None
            else np.full(n, np.nan, np.float32),
            versions=np.asarray(r.prefix_versions, np.int32)
            if r.prefix_versions is not None
            else np.full(n, -1, np.int32),
            routed_experts=r.prefix_routed_experts,
            prompt_routed_experts=r.prompt_routed_experts,
        )

    async def next_finished(self, timeout_s: float | None = None) -> Output:
        """The final delta of the next response that finished (stop, length or error), in arrival order;
        the whole response is `self.responses[out.rid]`."""
        self._raise_failure()
        if not self._finished.empty():  # the common case under load: no timer, no task
            out = self._finished.get_nowait()
        else:
            out = await asyncio.wait_for(self._finished.get(), timeout_s)
        if out is None:
            self._raise_failure()
        return out

    def finished_nowait(self) -> list[Output]:
        self._raise_failure()
        out = []
        while not self._finished.empty():
            item = self._finished.get_nowait()
            if item is None:
                self._raise_failure()
            out.append(item)
        return out

    async def finished(self) -> AsyncIterator[Output]:
        while True:
            yield await self.next_finished()

    async def pause(self) -> dict[str, Output]:
        """Stop generation everywhere. Returns each live response's delta since its last report (already
        applied to the tracked copies); once it returns, every response that finished before the pause has
        also been delivered as finished. Servers already paused are skipped; when one server fails, the
        deltas of those that paused are kept and returned by the next pause (the retry after recovery)."""
        alive = [s for s in self._alive() if not s.paused]
        replies = await asyncio.gather(*(s.conn.pause() for s in alive), return_exceptions=True)
        self.last_pause = []
        t0 = time.perf_counter()
        failed: BaseException | None = None
        done = []
        for s, reply in zip(alive, replies, strict=True):
            if isinstance(reply, BaseException):
                failed = failed or reply
                continue
            outs, body = reply
            s.paused = True
            done.append((s, body))
            self.last_pause.append(body)
            for out in outs:
                tr = self.responses.get(out.rid)
                if tr is not None:
                    tr.apply(out)
                self._unreported[out.rid] = out
        for body in self.last_pause:
            body["client_apply_s"] = time.perf_counter() - t0
        if failed is not None:
            raise failed
        t1 = time.perf_counter()
        await asyncio.gather(*(self._await_seq(s, body["event_seq"]) for s, body in done))
        for body in self.last_pause:
            body["client_await_events_s"] = time.perf_counter() - t1
        deltas, self._unreported = self._unreported, {}
        return deltas

    async def truncate(self, keep: dict[str, int]) -> None:
        """Cut responses to their verified prefixes (tokens, log-probs, versions, routes together)."""
        plan: dict[int, dict[str, int]] = {}
        for rid, k in keep.items():
            tr = self.responses.get(rid)
            if tr is None:
                raise ControlError(
                    ErrorCode.UNKNOWN_RESPONSE, f"response {rid} is not tracked by this client"
                )
            if not 0 <= k <= len(tr.token_ids):
                raise ControlError(
                    ErrorCode.KEEP_OUT_OF_RANGE,
                    f"keep {k} for response {rid} is outside [0, {len(tr.token_ids)}]",
                )
            plan.setdefault(tr.server, {})[rid] = int(k)
        detached = plan.pop(DETACHED, {})
        await asyncio.gather(*(self.servers[i].conn.truncate(p) for i, p in plan.items()))
        for i, p in plan.items():
            for rid, k in p.items():
                tr = self.responses[rid]
                was_finished = tr.finished
                tr.truncate(k)
                if was_finished and not tr.finished:
                    self.servers[i].live += 1
        # finished responses of a lost server: cut here; one cut short goes to an alive server, as a revival would
        revived = []
        for rid, k in detached.items():
            tr = self.responses[rid]
            tr.truncate(k)
            if not tr.finished:
                revived.append(self.responses.pop(rid).as_submit())
        if revived:
            await self.submit(revived)

    async def resume(self) -> None:
        """Relaunch every live response from its kept prefix under each server's current weights."""
        alive = self._alive()
        await asyncio.gather(*(s.conn.resume() for s in alive))
        for s in alive:
            s.paused = False

    async def update_weights(
        self, buckets: Iterable[Iterable[tuple[str, Any]]], version: int, servers: Sequence[int] | None = None
    ) -> None:
        """Send (hf_name, tensor) buckets to every server (or to `servers`), streaming (one bucket of look-ahead
        marks the last one, which commits). A server applies nothing unless every bucket it received was valid."""
        alive = self._alive() if servers is None else [self.servers[i] for i in servers]
        it = iter(buckets)
        current = next(it, None)
        if current is None:
            raise ValueError("update_weights needs at least one bucket")
        i = 0
        while current is not None:
            following = next(it, None)
            bucket = list(current)
            commit = following is None
            await asyncio.gather(
                *(s.conn.update_weights(bucket, version, bucket=i, commit=commit) for s in alive)
            )
            current, i = following, i + 1
        for s in alive:
            s.version = version

    async def update_weights_from_disk(self, path: str | Path, version: int) -> None:
        alive = self._alive()
        await asyncio.gather(*(s.conn.update_weights_from_disk(path, version) for s in alive))
        for s in alive:
            s.version = version

    async def flush(self) -> None:
        await asyncio.gather(*(s.conn.flush() for s in self._alive()))

    async def drop(self, rids: Sequence[str]) -> None:
        """Forget responses (the loop has consumed them); running ones are aborted."""
        plan: dict[int, list[str]] = {}
        for rid in rids:
            tr = self.responses.get(rid)
            if tr is None:
                raise ControlError(
                    ErrorCode.UNKNOWN_RESPONSE, f"response {rid} is not tracked by this client"
                )
            plan.setdefault(tr.server, []).append(rid)
        detached = plan.pop(DETACHED, [])
        await asyncio.gather(
            *(self.servers[i].conn.drop(r) for i, r in plan.items() if self.servers[i].alive)
        )
        for i, rs in plan.items():
            for rid in rs:
                tr = self.responses.pop(rid)
                self.servers[i].rids.discard(rid)
                if not tr.finished:
                    self.servers[i].live -= 1
        for rid in detached:
            del self.responses[rid]

    async def stats(self, engine: bool = False) -> list[dict]:
        return await asyncio.gather(*(self._safe(s, s.conn.stats(engine)) for s in self.servers))

    async def health(self) -> list[dict]:
        return await asyncio.gather(*(self._safe(s, s.conn.health(timeout_s=10.0)) for s in self.servers))

    async def _safe(self, s: ServerState, coro) -> dict:
        if not s.alive:
            coro.close()
            return {"ok": False, "endpoint": s.conn.endpoint, "alive": False}
        try:
            return {"endpoint": s.conn.endpoint, **(await coro)}
        except ControlError as e:
            if e.code == UNAVAILABLE:
                s.alive = False
            return {"ok": False, "endpoint": s.conn.endpoint, "error": str(e)}

    async def shutdown(self) -> None:
        """Stop every server (each ends its engine and children), then close the connections."""
        for s in self.servers:
            if s.alive:
                with contextlib.suppress(ControlError):
                    await s.conn.shutdown()
                s.alive = False
        await self.close()

    async def mark_dead(self, server: int) -> None:
        """Stop talking to a server known to be gone (its process exited): no more polls, no pending calls."""
        s = self.servers[server]
        s.alive = False
        await self._stop_poller(s)
        await s.conn.close()
        async with s.seq_cond:
            s.seq_cond.notify_all()

    async def orphans(self, server: int) -> list[TrackedResponse]:
        """Forget the unfinished responses of a dead server and return them as the controller last saw them
        (the last pause or finish: whatever the server generated after that is lost and will be regenerated).
        Its finished ones stay tracked, detached from any server, until dropped or truncated (see truncate)."""
        dead = self.servers[server]
        moved = [tr for tr in self.responses.values() if tr.server == server and not tr.finished]
        for tr in moved:
            del self.responses[tr.rid]
        for tr in self.responses.values():
            if tr.server == server:
                tr.server = DETACHED
        dead.rids.clear()
        dead.live = 0
        return moved

    async def reconnect(self, server: int, endpoint: str) -> None:
        """Point slot `server` at a new process (a restart): fresh connection, its version and paused state
        read from its health reply, event sequence from zero."""
        s = self.servers[server]
        if s.alive:
            raise ValueError(f"server {server} is alive: mark it dead before reconnecting")
        old = s.conn
        s.conn = ServerConnection(endpoint, curve=old.curve, timeout_s=old.timeout_s)
        await s.conn.start()
        info = await s.conn.health()
        s.version, s.paused, s.last_seq, s.alive = info["version"], info["paused"], 0, True
        s.poller = asyncio.ensure_future(self._poll(s))

    async def recover(self, server: int) -> list[str]:
        """Move the live responses of a dead server to the alive ones (see `orphans`). Returns the moved ids."""
        await self.mark_dead(server)
        moved = await self.orphans(server)
        if moved:
            await self.submit([tr.as_submit() for tr in moved])
        return [tr.rid for tr in moved]


# ---------------------------------------------------------------------------------------------- sync + sink


class SyncRolloutClient:
    """RolloutClient on a private event-loop thread, for synchronous callers (the trainer loop)."""

    def __init__(self, endpoints: Sequence[str], **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self.client: RolloutClient = self._run(self._make(endpoints, kwargs))

    async def _make(self, endpoints, kwargs) -> RolloutClient:
        return await RolloutClient(endpoints, **kwargs).start()

    def _run(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        if asyncio.iscoroutinefunction(attr):
            return lambda *a, **k: self._run(attr(*a, **k))
        return attr

    def next_finished(self, timeout_s: float | None = None) -> Output:
        return self._run(self.client.next_finished(timeout_s))

    def finished_nowait(self) -> list[Output]:
        """Finished responses already received (read on the client's loop: asyncio queues are not thread-safe)."""

        async def take() -> list[Output]:
            return self.client.finished_nowait()

        return self._run(take())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self.client.close(), timeout_s=60.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WeightSink:
    """The trainer's end of weight updates: buckets of (hf_name, tensor) with a version, or a folder on disk,
    to every rollout server. Works with either client flavour."""

    def __init__(self, client: RolloutClient | SyncRolloutClient):
        self.client = client

    def _call(self, name: str, *args):
        fn = getattr(self.client, name)
        return fn(*args)

    def send(self, buckets: Iterable[Iterable[tuple[str, Any]]], version: int):
        """Sync client: blocks until every server committed. Async client: returns the coroutine."""
        return self._call("update_weights", buckets, version)

    def send_from_disk(self, path: str | Path, version: int):
        return self._call("update_weights_from_disk", path, version)
