"""GPU weight transports and the colocated memory handoff: weights_group, update_weights_distributed,
update_weights_ipc, memory (docs/protocol.md, "Weight transports").

The bytes of a weight version never cross this channel: `update_weights_distributed` announces a bucket whose
bytes the trainer's source rank broadcasts over the weight-update group the server joined with `weights_group`
(NCCL on GPUs, gloo on CPU); `update_weights_ipc` carries a serialized flattened bucket, which on a GPU is a CUDA
IPC handle of the colocated trainer rank's memory. Both stream a version as numbered buckets inside one SGLang
weight-update session, then a commit step; the served version changes at the commit only, after every bucket
arrived. SGLang loads each bucket as it arrives, so a version that fails after its first bucket leaves a mix of
two policies in the engine: the server then keeps reporting the old version and refuses to launch any request
(`Records.blocked`) until a whole version (or a checkpoint from disk) has been loaded.

`memory` releases and resumes SGLang's GPU memory (weights, KV cache, CUDA graphs) for a colocated trainer;
it needs nothing generating, and resumes only what it released (SGLang's scheduler dies otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from sglang_ext.dispatch import Handler, Reply
from sglang_ext.handlers.weights import check_tensor_specs
from sglang_ext.protocol import (
    DistributedBucketBody,
    ErrorCode,
    IpcBucketBody,
    MemoryBody,
    Message,
    ProtocolError,
    WeightsGroupBody,
)

if TYPE_CHECKING:
    from sglang_ext.engine import EngineTransport
    from sglang_ext.server import ControlServer

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class Stream:
    """The version being streamed: its transport, the next bucket expected, how many tensors loaded."""

    transport: str
    version: int
    next_bucket: int = 0
    tensors: int = 0
    engine_s: float = 0.0


class TransportHandlers:
    def __init__(self, server: ControlServer):
        self.server = server
        self.records = server.records
        self.groups: dict[str, int] = {}  # weight-update groups joined: name -> this server's first rank
        self.stream: Stream | None = None
        self.released: set[str] = set()

    @property
    def transport(self) -> EngineTransport:
        """The engine's weight-transport and memory calls (EngineHandle.transport)."""
        return self.server.engine.transport

    def handlers(self) -> dict[str, Handler]:
        return {
            "weights_group": self.weights_group,
            "update_weights_distributed": self.update_weights_distributed,
            "update_weights_ipc": self.update_weights_ipc,
            "memory": self.memory,
        }

    # -------------------------------------------------------------------------------- handlers

    async def weights_group(self, body: WeightsGroupBody, msg: Message) -> Reply:
        """Join the trainer's weight-update group as ranks rank_offset .. rank_offset + tp - 1; answers once the
        whole group has formed (the trainer's source rank joins as rank 0)."""
        tp = int(getattr(self.server.engine, "tp_size", 1))
        if body.rank_offset + tp > body.world_size:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"weights_group: this server's {tp} TP rank(s) from rank_offset {body.rank_offset} do not fit in "
                f"world_size {body.world_size}; give each server rank_offset 1 + the TP sizes of those before it",
            )
        if body.group in self.groups:
            raise ProtocolError(ErrorCode.INVALID, f"weights_group: already in group {body.group!r}; use a new name")
        t0 = time.perf_counter()
        async with self.server.engine_calls.call():
            await self.transport.join_weight_group(
                body.master_addr, body.master_port, body.rank_offset, body.world_size, body.group, body.backend
            )
        self.groups[body.group] = body.rank_offset
        return {"group": body.group, "ranks": list(range(body.rank_offset, body.rank_offset + tp)),
                "tp_size": tp, "engine_s": time.perf_counter() - t0}, None, None

    async def update_weights_distributed(self, body: DistributedBucketBody, msg: Message) -> Reply:
        """One step of a version streamed over the weight-update group: a bucket (received from the broadcast
        and loaded), the commit, or an abort."""
        if body.step == "bucket":
            if body.group not in self.groups:
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"update_weights_distributed: not in weight-update group {body.group!r} (joined: "
                    f"{sorted(self.groups)}); send weights_group first. Nothing was applied",
                )
            self._check_meta(body.names, body.dtypes, body.shapes)
            return await self._bucket(
                "distributed", body.version, body.bucket,
                lambda: self.transport.receive_bucket(body.names, body.dtypes, body.shapes, body.group),
                len(body.names),
            )
        return await self._finish("distributed", body.step, body.version, body.buckets, body.reason)

    async def update_weights_ipc(self, body: IpcBucketBody, msg: Message) -> Reply:
        """One step of a version streamed as serialized flattened buckets (CUDA IPC handles on a GPU): a bucket,
        the commit, or an abort."""
        if body.step == "bucket":
            tp = int(getattr(self.server.engine, "tp_size", 1))
            if len(body.payloads) != tp:
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"update_weights_ipc: {len(body.payloads)} payloads for {tp} TP rank(s); one each. "
                    "Nothing was applied",
                )
            self._check_meta(body.names, body.dtypes, body.shapes)
            return await self._bucket(
                "ipc", body.version, body.bucket, lambda: self.transport.load_flattened(body.payloads),
                len(body.names),
            )
        return await self._finish("ipc", body.step, body.version, body.buckets, body.reason)

    async def memory(self, body: MemoryBody, msg: Message) -> Reply:
        """Release or resume SGLang's memory of `tags` (all three when empty)."""
        tags = list(dict.fromkeys(body.tags or MEMORY_TAGS))
        await self.records.require_idle(f"memory {body.action}")
        if self.stream is not None:
            raise ProtocolError(ErrorCode.BUSY, f"memory {body.action}: a weight version is being streamed")
        if body.action == "release":
            again = [t for t in tags if t in self.released]
            if again:
                raise ProtocolError(ErrorCode.INVALID, f"memory release: {again} already released; resume first")
        else:
            missing = [t for t in tags if t not in self.released]
            if missing:
                raise ProtocolError(
                    ErrorCode.INVALID, f"memory resume: {missing} were not released (released: {sorted(self.released)})"
                )
        t0 = time.perf_counter()
        async with self.server.engine_calls.call():
            if body.action == "release":
                await self.transport.release_memory(tags)
                self.released.update(tags)
            else:
                await self.transport.resume_memory(tags)
                self.released.difference_update(tags)
        return {"action": body.action, "tags": tags, "released": sorted(self.released),
                "engine_s": time.perf_counter() - t0}, None, None

    # ------------------------------------------------------------------------------------- streaming

    def _check_meta(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Every tensor of a bucket against the served checkpoint, before any byte is received (the body's
        validation made names, dtypes and shapes one per tensor)."""
        check_tensor_specs(self.server.info.weights, zip(names, dtypes, shapes, strict=True),
                           "Nothing of this bucket was applied")

    async def _bucket(self, transport: str, version: int, index: int, load: Callable[[], Awaitable[None]],
                      tensors: int) -> Reply:
        """Bucket `index` of `version`: bucket 0 opens SGLang's weight-update session; a bucket out of sequence
        ends the stream (as an abort would)."""
        await self.records.require_idle(f"update_weights_{transport}")
        stream = self.stream
        if index == 0 and stream is None:
            stream = Stream(transport, version)
        elif stream is None or (stream.transport, stream.version, stream.next_bucket) != (transport, version, index):
            expect = "bucket 0" if stream is None else (
                f"bucket {stream.next_bucket} of version {stream.version} ({stream.transport})")
            await self._refuse_out_of_sequence(
                f"bucket {index} of version {version} arrived out of sequence",
                f"got {transport} bucket {index} of version {version} but expected {expect}; the stream was ended",
            )
        t0 = time.perf_counter()
        async with self.server.engine_calls.call():
            try:
                if index == 0:
                    await self.transport.begin_weight_update()
                    self.stream = stream
                await load()
            except Exception as e:
                await self._end_stream(f"bucket {index} of version {version} failed to load: {e}")
                raise ProtocolError(
                    ErrorCode.ENGINE_ERROR, f"bucket {index} of version {version}: {e}. {self._state()}"
                ) from e
        stream.next_bucket += 1
        stream.tensors += tensors
        stream.engine_s += time.perf_counter() - t0
        return {"version": self.records.version, "committed": False, "bucket": index,
                "tensors": stream.tensors}, None, None

    async def _finish(self, transport: str, step: str, version: int, buckets: int, reason: str) -> Reply:
        stream = self.stream
        if step == "abort":
            if stream is not None:
                await self._end_stream(f"aborted by the trainer: {reason or 'no reason given'}")
            return {"version": self.records.version, "committed": False, "aborted": stream is not None,
                    "blocked": self.records.blocked}, None, None
        if stream is None or (stream.transport, stream.version, stream.next_bucket) != (transport, version, buckets):
            got = "no stream" if stream is None else (
                f"{stream.next_bucket} bucket(s) of version {stream.version} ({stream.transport})")
            await self._refuse_out_of_sequence(
                f"commit of {buckets} bucket(s) of version {version} did not match {got}",
                f"commit of {buckets} {transport} bucket(s) of version {version}, but this server has {got}",
            )
        t0 = time.perf_counter()
        async with self.server.engine_calls.call():
            try:
                await self.transport.end_weight_update()
                self.stream = None
                await self.server.engine.flush()
            except Exception as e:
                self.stream = None
                self.records.blocked = f"version {version} failed at its commit: {e}"
                raise ProtocolError(ErrorCode.ENGINE_ERROR, f"commit of version {version}: {e}. {self._state()}") from e
        self.records.version = version
        self.records.blocked = None
        return {"version": version, "committed": True, "buckets": buckets, "tensors": stream.tensors,
                "engine_s": stream.engine_s + time.perf_counter() - t0}, None, None

    async def _refuse_out_of_sequence(self, why: str, message: str) -> NoReturn:
        """A bucket or commit that does not continue the stream: the stream ends (as an abort would, `why`
        recorded where a bucket had loaded) and the step is refused with WEIGHT_SEQUENCE."""
        await self._end_stream(why)
        raise ProtocolError(ErrorCode.WEIGHT_SEQUENCE, f"{message}. {self._state()}")

    async def _end_stream(self, why: str) -> None:
        """Close SGLang's session of a stream that will not commit. Once a bucket has loaded the engine holds
        a mix of two versions: launching is blocked until a whole version arrives."""
        stream, self.stream = self.stream, None
        if stream is None:
            return
        self.records.blocked = f"weights of version {stream.version} were partly loaded ({why})"
        try:
            await self.transport.end_weight_update()
        except Exception as e:  # the session may already be gone with the failure that ended the stream
            self.records.blocked = self.records.blocked or f"weight update session left open ({e})"

    def _state(self) -> str:
        if self.records.blocked:
            return (f"The server still reports version {self.records.version} and launches nothing until a whole "
                    f"version is loaded: {self.records.blocked}")
        return f"Nothing was applied: version {self.records.version} keeps serving"
