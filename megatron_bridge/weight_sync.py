"""Weight sync trainer -> engines: HF-named tensors in buckets, tagged with the policy version.

The trainer builds its weights in HF naming a bucket at a time, every rank together (`convert.iter_hf_buckets`:
one collective per bucket); `sync_buckets` hands each bucket to the sending rank's sink (rank 0 unless a
transport has other ranks send), and `sync` does the same for a stream of single tensors, grouped into buckets
of about `bucket_bytes`:

    sink.begin(version); sink.push(bucket) ...; sink.end(version)

`WeightSink` is the whole contract of the sending side; every sink is one of the classes below or a pipe that
forwards to one (`spawned._PipeSink`, `ray_trainer._QueueSink`). No SGLang class is a sink: the in-memory path
hands the buckets to the rollout engine's `update_weights(buckets, version)` (`rollverify.interfaces`; pause,
flush, update and resume belong to that side), and the GPU transports' servers are driven through a
`BucketControl` (the server wing's `sglang_ext.weight_transport.ServerControl`; rollverify.app.weight_transport
joins the two ends). Here:

* `InMemorySink`: keeps the tensors (tests, in-process engines on CPU);
* `DiskSink`: writes an HF checkpoint folder (for `update_weights_from_disk`, and the export);
* `CallableSink`: adapts a plain `fn(bucket, version)`;
* GPU transports, streamed from the trainer's ranks straight to the servers (rollverify/app/weight_transport.py
  chooses them): `TransportSink` moves each bucket as one flattened buffer (SGLang's `FlattenedTensorBucket`
  layout, `flatten_bucket`: one finite check per bucket) with a `BucketSender`: `BroadcastSender` over SGLang's
  weight-update group (`join_weight_group`: NCCL on GPU, gloo on CPU), or `IpcSender` with one serialized payload
  per server TP rank, each built on that rank's GPU by the trainer rank there (`IpcPeer`; CUDA IPC handles on
  GPU, shared memory on CPU), while a `BucketControl` carries the metadata and the commit; pipelined by one
  bucket. `ipc_handles` serialises a bucket for the spawned trainer's pipe (GPU tensors as handles).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

Bucket = list[tuple[str, torch.Tensor]]


@runtime_checkable
class WeightSink(Protocol):
    def begin(self, version: int) -> None: ...

    def push(self, bucket: Bucket) -> None: ...

    def end(self, version: int) -> None: ...


class CallableSink:
    """`fn(bucket, version)` per bucket; begin/end do nothing."""

    def __init__(self, fn: Callable[[Bucket, int], None]) -> None:
        self.fn = fn
        self.version = -1

    def begin(self, version: int) -> None:
        self.version = version

    def push(self, bucket: Bucket) -> None:
        self.fn(bucket, self.version)

    def end(self, version: int) -> None:
        pass


class InMemorySink:
    """Collects CPU copies of every tensor; `state` is complete after `end`."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.buckets = 0

    def begin(self, version: int) -> None:
        self.state, self.buckets = {}, 0

    def push(self, bucket: Bucket) -> None:
        for name, t in bucket:
            if name in self.state:
                raise ValueError(f"tensor {name} pushed twice in one sync")
            self.state[name] = t.detach().to("cpu", copy=True)
        self.buckets += 1

    def end(self, version: int) -> None:
        self.version = version


class DiskSink:
    """Writes an HF folder: config and tokenizer files copied from `source_dir`, weights as safetensors shards
    (one per bucket) with an index, written to a temporary folder and renamed at `end` so a reader never sees a
    half-written checkpoint."""

    _COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt")

    def __init__(self, out_dir: str | Path, source_dir: str | Path | None = None) -> None:
        self.out = Path(out_dir)
        self.source = Path(source_dir) if source_dir else None
        self.tmp: Path | None = None
        self.weight_map: dict[str, str] = {}
        self.version: int | None = None

    def begin(self, version: int) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{version}-{time.monotonic_ns()}"
        self.tmp.mkdir()
        self.weight_map = {}

    def push(self, bucket: Bucket) -> None:
        from safetensors.torch import save_file

        assert self.tmp is not None, "push before begin"
        name = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in bucket}, str(self.tmp / name),
                  metadata={"format": "pt"})
        self.weight_map.update({k: name for k, _ in bucket})

    def end(self, version: int) -> None:
        assert self.tmp is not None
        (self.tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"rollverify_version": version}, "weight_map": self.weight_map}, indent=1))
        if self.source is not None:
            for f in self._COPY:
                if (self.source / f).is_file():
                    shutil.copy2(self.source / f, self.tmp / f)
        if self.out.exists():
            shutil.rmtree(self.out)
        self.tmp.rename(self.out)
        self.tmp, self.version = None, version


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterable[Bucket]:
    cur: Bucket = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def sync(tensors: Iterable[tuple[str, torch.Tensor]], sink: WeightSink | Callable | None, version: int, *,
         bucket_bytes: int = 64 << 20, is_driver: bool = True) -> dict[str, float]:
    """Drain `tensors` (every rank must: the iterator is collective) in buckets and feed the driver's sink."""
    return sync_buckets(buckets(tensors, bucket_bytes), sink, version, is_driver=is_driver)


def sync_buckets(stream: Iterable[Bucket], sink: WeightSink | Callable | None, version: int, *,
                 is_driver: bool = True) -> dict[str, float]:
    """Drain the buckets of `stream` (every rank must: building each is collective) into the driver's sink."""
    if sink is not None and not isinstance(sink, WeightSink):
        sink = CallableSink(sink)
    t0 = time.perf_counter()
    n_bytes = n_tensors = n_buckets = 0
    if is_driver and sink is not None:
        sink.begin(version)
    for bucket in stream:
        n_buckets += 1
        n_tensors += len(bucket)
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if is_driver and sink is not None:
            sink.push(bucket)
    if is_driver and sink is not None:
        sink.end(version)
    extra = sink.stats() if is_driver and hasattr(sink, "stats") else {}
    return {"sync_time_s": time.perf_counter() - t0, "sync_bytes": float(n_bytes), "sync_tensors": float(n_tensors),
            "sync_buckets": float(n_buckets), "version": float(version), **extra}


# ---------------------------------------------------------------------------------------------- GPU transports


def ipc_handles(bucket: Bucket) -> bytes:
    """Serialise a bucket for a colocated engine: CUDA tensors travel as CUDA IPC handles (no copy), CPU
    tensors as shared memory. The receiver calls `load_ipc_handles`; the sender must keep the tensors alive
    until the receiver has copied them (the engine's update op is synchronous)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(bucket)
    return buf.getvalue()


def load_ipc_handles(payload: bytes) -> Bucket:
    import pickle

    import torch.multiprocessing  # noqa: F401

    return pickle.loads(payload)


@dataclass(frozen=True)
class BucketMeta:
    """What a receiver allocates for one bucket before its bytes arrive: names, dtypes, shapes, in order. The
    bytes are SGLang's flattened-bucket layout (`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket`):
    each tensor's bytes, in this order, back to back."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int

    @classmethod
    def of(cls, bucket: Bucket) -> BucketMeta:
        return cls(tuple(n for n, _ in bucket), tuple(str(t.dtype).removeprefix("torch.") for _, t in bucket),
                   tuple(tuple(t.shape) for _, t in bucket), sum(t.numel() * t.element_size() for _, t in bucket))

    def as_body(self) -> dict:
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes]}


def flatten_bucket(bucket: Bucket) -> tuple[torch.Tensor, BucketMeta]:
    """One uint8 tensor holding the bucket's bytes (on the tensors' device), and its meta. Refuses non-finite
    values, with one check for the whole bucket (one host sync, not one per tensor): the receivers load what
    arrives without looking at it."""
    offset = 0
    for name, t in bucket:
        if offset % t.element_size():
            raise ValueError(f"tensor {name} ({t.dtype}) would start at byte offset {offset} of its bucket, not a "
                             f"multiple of {t.element_size()}: receivers view it in place; order a mixed-dtype "
                             "bucket by element size")
        offset += t.numel() * t.element_size()
    floats = [(n, t) for n, t in bucket if t.is_floating_point()]
    if floats:
        finite = torch.stack([torch.isfinite(t).all() for _, t in floats])  # on the device, no sync yet
        if not bool(finite.all()):  # the bucket's one host sync
            bad = [n for (n, _), ok in zip(floats, finite.tolist(), strict=True) if not ok]
            raise ValueError(f"weights {bad[:5]} hold non-finite values (NaN or inf); nothing was sent")
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
    return flat, BucketMeta.of(bucket)


def join_weight_group(master_addr: str, master_port: int, world_size: int, group_name: str, backend: str,
                      timeout_s: float) -> dist.ProcessGroup:
    """Join SGLang's weight-update group as its rank 0 (the source). The group is SGLang's
    `init_custom_process_group` (sglang/srt/utils/common.py): a tcp:// rendezvous whose store is prefixed with
    the group name, beside any default group; this builds the same one without importing SGLang. Blocks until
    every server rank has joined (or `timeout_s`)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, _ = next(rendezvous(f"tcp://{master_addr}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@runtime_checkable
class BucketControl(Protocol):
    """The control side of a transport (messages to the servers; tensor bytes never pass through it).

    `announce` tells every server what bucket `index` holds before its bytes travel and returns without waiting
    for them; `settle` waits until every server has loaded it. `commit` makes `version` current on every
    server only after every one has loaded every bucket; `abort` leaves each on its old version."""

    def begin(self, version: int) -> None: ...

    def announce(self, index: int, meta: BucketMeta, payloads: dict[int, list[bytes]] | None = None) -> None:
        """`payloads` (ipc): server index -> one serialized payload per TP rank of that server."""
        ...

    def settle(self, index: int) -> None: ...

    def commit(self, version: int, buckets: int) -> None: ...

    def abort(self, version: int, reason: str) -> None: ...

    def close(self) -> None: ...

    def control_bytes(self) -> int:
        """Bytes sent to the servers over the control channel so far (bucket metadata, IPC handles)."""
        ...


class BucketSender(Protocol):
    """How a transport moves a bucket's bytes: `prepare` runs while the servers still load the previous bucket
    (an IPC payload and its gather), `send` after they loaded it (announce, and the broadcast); `finish` after
    the commit. Whatever `prepare` returns stays alive until the bucket has loaded."""

    def prepare(self, flat: torch.Tensor, meta: BucketMeta, index: int) -> Any: ...

    def send(self, prepared: Any, meta: BucketMeta, index: int) -> None: ...

    def finish(self) -> None: ...


class TransportSink:
    """A `WeightSink` on a source rank that streams buckets straight to the servers: `sender` moves the bytes
    (a broadcast, or CUDA IPC handles), `control` carries the rest. Pipelined by one bucket: while the servers
    load bucket k the trainer builds bucket k + 1 (its gathers, its one finite check, its payloads), then waits
    for k and sends k + 1; so at most two buckets are alive, and no process ever holds a whole copy of the
    model."""

    def __init__(self, control: BucketControl, sender: BucketSender) -> None:
        self.control, self.sender = control, sender
        self.version, self.index, self.bytes = -1, 0, 0
        self.inflight: tuple[int, Any] | None = None  # (index, what keeps its bytes alive) until it has loaded

    def begin(self, version: int) -> None:
        self.version, self.index, self.bytes, self.inflight = version, 0, 0, None
        self.control.begin(version)

    def push(self, bucket: Bucket) -> None:
        with self._aborting(f"bucket {self.index}"):
            flat, meta = flatten_bucket(bucket)
            prepared = self.sender.prepare(flat, meta, self.index)
            self._settle()
            self.sender.send(prepared, meta, self.index)
            self.inflight = (self.index, (flat, prepared))
        self.index += 1
        self.bytes += meta.nbytes

    def _settle(self) -> None:
        if self.inflight is not None:
            self.control.settle(self.inflight[0])
            self.inflight = None
            collect_ipc()  # the servers have loaded it: its buffer goes back to the allocator

    def stats(self) -> dict[str, float]:
        return {"sync_control_bytes": float(self.control.control_bytes())}

    def end(self, version: int) -> None:
        try:
            with self._aborting("commit", close=False):
                self._settle()
                self.control.commit(version, self.index)
            self.sender.finish()
        finally:
            self.control.close()
            collect_ipc()

    @contextlib.contextmanager
    def _aborting(self, what: str, close: bool = True):
        try:
            yield
        except BaseException as e:
            try:
                self.control.abort(self.version, f"{what}: {type(e).__name__}: {e}")
            finally:
                if close:
                    self.control.close()
            raise


class BroadcastSender:
    """Disaggregated: announce the bucket (the servers start receiving), then broadcast its bytes from rank 0
    of the weight-update group `group`."""

    def __init__(self, control: BucketControl, group: dist.ProcessGroup) -> None:
        self.control, self.group = control, group

    def prepare(self, flat: torch.Tensor, meta: BucketMeta, index: int) -> torch.Tensor:
        return flat

    def send(self, prepared: torch.Tensor, meta: BucketMeta, index: int) -> None:
        self.control.announce(index, meta)
        dist.broadcast(prepared, src=0, group=self.group)

    def finish(self) -> None:
        pass


Serialize = Callable[[torch.Tensor, BucketMeta], bytes]


def device_tag(t: torch.Tensor) -> str:
    """The GPU a tensor lives on, as every process names it (its UUID: processes see other
    CUDA_VISIBLE_DEVICES); on CPU the GPU the rank stands for (`LOCAL_RANK`), so the CPU path checks the same
    placement."""
    if t.is_cuda:
        return f"cuda:{torch.cuda.get_device_properties(t.device).uuid}"
    return f"cpu:{os.environ.get('LOCAL_RANK', '0')}"


@dataclass(frozen=True)
class IpcServer:
    """One colocated server as its source rank sees it: `index` among the control's servers, its TP size, and
    the gloo group of the trainer ranks on its GPUs in TP order (this rank first; None: this rank alone)."""

    index: int
    tp: int
    group: Any = None


class IpcSender:
    """Colocated: each server TP rank j gets its own payload (`serialize(flat, meta)`: SGLang's flattened bucket,
    sglang_ext.tensor_payload.serialize_flattened) of the bucket as built on its own GPU, by the trainer rank
    there (`IpcPeer`), gathered to this source rank over the server's group; SGLang's TP rank j reads only
    payload j (sglang/srt/managers/tp_worker.py). A CUDA tensor travels as a CUDA IPC handle (the server maps the
    producing rank's memory: no copy), a CPU one through torch's shared memory. A server with TP ranks on GPUs
    no trainer rank holds (CPU layouts only) gets a distinct serialization per TP rank from this rank."""

    def __init__(self, control: BucketControl, servers: list[IpcServer], serialize: Serialize) -> None:
        self.control, self.servers, self.serialize = control, servers, serialize
        self.devices: dict[int, list[str]] = {}  # server -> the GPU each TP rank's last payload was built on

    def prepare(self, flat: torch.Tensor, meta: BucketMeta, index: int) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for s in self.servers:
            if s.group is None:
                if flat.is_cuda and s.tp > 1:
                    raise ValueError(f"server {s.index} has {s.tp} TP ranks but no trainer ranks on its other GPUs: "
                                     "a colocated server's GPUs must each hold a trainer rank")
                out[s.index] = [self.serialize(flat, meta) for _ in range(s.tp)]
                self.devices[s.index] = [device_tag(flat)] * s.tp
                continue
            got: list[Any] = [None] * s.tp
            dist.gather_object((device_tag(flat), self.serialize(flat, meta)), got, dst=dist.get_global_rank(
                s.group, 0), group=s.group)
            tags = [t for t, _ in got]
            if len(set(tags)) != len(tags):
                raise ValueError(f"server {s.index}: payloads of its TP ranks come from GPUs {tags}; each must come "
                                 "from its own GPU")
            out[s.index], self.devices[s.index] = [p for _, p in got], tags
        return out

    def send(self, prepared: dict[int, list[bytes]], meta: BucketMeta, index: int) -> None:
        self.control.announce(index, meta, prepared)

    def finish(self) -> None:
        for s in self.servers:  # the peers keep their buffers until the commit
            if s.group is not None:
                dist.barrier(group=s.group)


class IpcPeer:
    """The `WeightSink` of a trainer rank on a colocated server's GPU other than its first: each bucket built
    on this GPU, serialized, gathered to the server's source rank (`IpcSender`). A bucket's buffer stays alive
    until the bucket after next (the source waits for bucket k before it gathers k + 2) and the last ones
    until the source's commit."""

    def __init__(self, group: Any, serialize: Serialize) -> None:
        self.group, self.serialize = group, serialize
        self.alive: list[torch.Tensor] = []

    def begin(self, version: int) -> None:
        self.alive = []

    def push(self, bucket: Bucket) -> None:
        flat, meta = flatten_bucket(bucket)
        dist.gather_object((device_tag(flat), self.serialize(flat, meta)), None,
                           dst=dist.get_global_rank(self.group, 0), group=self.group)
        dropped = len(self.alive) > 1
        self.alive = [*self.alive[-1:], flat]
        if dropped:
            collect_ipc()

    def end(self, version: int) -> None:
        dist.barrier(group=self.group)
        self.alive = []
        collect_ipc()


def collect_ipc() -> None:
    """Free the buckets whose CUDA IPC handles the servers' TP ranks have closed (`torch.cuda.ipc_collect`):
    torch keeps a block shared over IPC until its consumers drop it and this runs, so without it the freed
    buckets' memory stays in limbo beside the servers' pools. Nothing to do off CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


_IPC_GROUPS: dict[tuple[int, ...], Any] = {}


def ipc_group(ranks: tuple[int, ...]) -> Any:
    """The gloo group of the trainer ranks on one colocated server's GPUs (made once per rank set; collective:
    every rank of the trainer calls it for every set, in the same order)."""
    key = tuple(ranks)
    if key not in _IPC_GROUPS:
        _IPC_GROUPS[key] = dist.new_group(list(key), backend="gloo")
    return _IPC_GROUPS[key]
