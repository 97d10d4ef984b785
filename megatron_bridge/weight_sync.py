"""Weight sync trainer -> engines: HF-named tensors in buckets, tagged with the policy version.

The trainer streams `(hf_name, tensor)` pairs (`MegatronTrainer.iter_hf_tensors`, collective over its ranks);
`sync` groups them into buckets of about `bucket_bytes` and hands each bucket to a sink on rank 0:

    sink.begin(version); sink.push(bucket) ...; sink.end(version)

`WeightSink` is the whole contract; the SGLang side implements it with its server's update-weights op
(pause, flush, update, resume belong to that side). Here:

* `InMemorySink`: keeps the tensors (tests, in-process engines on CPU);
* `DiskSink`: writes an HF checkpoint folder (for `update_weights_from_disk`, and the export);
* `CallableSink`: adapts a plain `fn(bucket, version)`;
* GPU transports: `ipc_handles(bucket)` serialises CUDA tensors as CUDA IPC handles for a colocated engine
  (same format torch.multiprocessing uses; the engine rebuilds tensors that alias the trainer's memory), and
  `BroadcastChannel` is a process group of its own (trainer rank 0 + engine ranks; NCCL on GPU, gloo on CPU,
  which the tests use) over which each bucket is broadcast from the trainer to disaggregated engines.
"""

from __future__ import annotations

import datetime
import io
import json
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

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
    """Drain `tensors` (every rank must: the iterator is collective) and feed the driver's sink."""
    if sink is not None and not isinstance(sink, WeightSink):
        sink = CallableSink(sink)
    t0 = time.perf_counter()
    n_bytes = n_tensors = n_buckets = 0
    if is_driver and sink is not None:
        sink.begin(version)
    for bucket in buckets(tensors, bucket_bytes):
        n_buckets += 1
        n_tensors += len(bucket)
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if is_driver and sink is not None:
            sink.push(bucket)
    if is_driver and sink is not None:
        sink.end(version)
    return {"sync_time_s": time.perf_counter() - t0, "sync_bytes": float(n_bytes), "sync_tensors": float(n_tensors),
            "sync_buckets": float(n_buckets), "version": float(version)}


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


class BroadcastChannel:
    """A process group of its own between trainer rank 0 (rank 0 here) and engine ranks 1..n-1, independent of
    the default group: the trainer broadcasts each tensor of a bucket; engines receive into buffers of the
    announced shapes. Bucket metadata (names, dtypes, shapes) reaches the engines through the control channel
    (`bucket_meta`), so only tensor bytes travel here."""

    def __init__(self, host: str, port: int, world_size: int, rank: int, backend: str | None = None,
                 timeout_s: float = 300.0) -> None:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefix = dist.PrefixStore("rollverify-weights", self.store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefix, rank, world_size, timeout=timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @staticmethod
    def bucket_meta(bucket: Bucket) -> list[tuple[str, str, list[int]]]:
        return [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in bucket]

    def send(self, bucket: Bucket) -> None:
        assert self.rank == 0
        for _, t in bucket:
            t = t.detach().to(self.device).contiguous()
            self.group.broadcast(t, 0).wait()

    def receive(self, meta: list[tuple[str, str, list[int]]]) -> Bucket:
        out: Bucket = []
        for name, dtype, shape in meta:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.group.broadcast(t, 0).wait()
            out.append((name, t))
        return out


class BroadcastSink:
    """Trainer-side sink for disaggregated engines: announces each bucket through `announce(meta, version)`
    (the control channel, e.g. the engine's update-weights-from-distributed request) and broadcasts it."""

    def __init__(self, channel: BroadcastChannel, announce: Callable[[list, int], None]) -> None:
        self.channel, self.announce = channel, announce
        self.version = -1

    def begin(self, version: int) -> None:
        self.version = version

    def push(self, bucket: Bucket) -> None:
        self.announce(BroadcastChannel.bucket_meta(bucket), self.version)
        self.channel.send(bucket)

    def end(self, version: int) -> None:
        pass
