"""`SpawnedTrainer`: N trainer ranks in child processes behind `MegatronTrainer`'s methods.

The driver (the loop's process) never imports Megatron-Core; it sends each call to every rank over a pipe
and returns rank 0's answer. Weight sync streams rank 0's buckets back over the pipe (as `torch.save` bytes for
CPU tensors, as CUDA IPC handles for GPU tensors) and feeds the driver's sink, so the sink object (an SGLang
client, a disk folder) stays in the driver. Any rank's exception is re-raised in the driver with its traceback;
a rank that dies or stalls past `timeout_s` fails the call instead of hanging it.
"""

from __future__ import annotations

import atexit
import io
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from megatron_bridge.parallel import free_port
from rollverify.app.config import TrainerConfig


def _pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[str, bytes]:
    if any(t.is_cuda for _, t in bucket):
        from megatron_bridge.weight_sync import ipc_handles

        return "ipc", ipc_handles(bucket)
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu()) for n, t in bucket], buf)
    return "bytes", buf.getvalue()


def _unpack(kind: str, payload: bytes) -> list[tuple[str, torch.Tensor]]:
    if kind == "ipc":
        from megatron_bridge.weight_sync import load_ipc_handles

        return load_ipc_handles(payload)
    return torch.load(io.BytesIO(payload), weights_only=True)


class _PipeSink:
    """Rank 0's sink inside a worker: forwards begin/push/end to the driver."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def begin(self, version: int) -> None:
        self.conn.send(("begin", version))

    def push(self, bucket) -> None:
        self.conn.send(("bucket", _pack(bucket)))
        if self.conn.recv() != "ack":  # keep the tensors alive until the driver has consumed them (IPC)
            raise RuntimeError("driver did not acknowledge a weight bucket")

    def end(self, version: int) -> None:
        self.conn.send(("end", version))


def start_rank(rank: int, world_size: int, master: tuple[str, int], model_path: str, cfg: TrainerConfig, dtype: str,
               seed: int, threads: int, local_rank: int | None = None):
    """One trainer rank in this process: the torch.distributed rendezvous at `master` (address, port) and its
    `MegatronTrainer`. `local_rank` is the GPU it uses (default: `rank`). Shared by both launchers' rank
    processes (the local child processes here, megatron_bridge.ray_trainer's actors)."""
    os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank if local_rank is None else local_rank))
    torch.set_num_threads(threads)
    from rollverify.app.console import quiet_cpu_warnings

    quiet_cpu_warnings()  # each rank is a fresh process: the driver's filters do not reach it
    from megatron_bridge.trainer import MegatronTrainer

    return MegatronTrainer(model_path, cfg, dtype=dtype, seed=seed)


def run_call(trainer, rank: int, method: str, args: tuple, kwargs: dict, sink) -> Any:
    """One driver call on one rank; weight streams go to `sink` on rank 0 (the other ranks take part in the
    gathers only). Returns what the driver gets from this rank: rank 0's result, None elsewhere."""
    if method == "sync_weights":
        result = trainer.sync_weights(sink if rank == 0 else None, *args, **kwargs)
    elif method == "iter_hf_tensors":
        result = trainer.sync_weights(sink if rank == 0 else None, trainer.version, *args, **kwargs)
    else:
        result = getattr(trainer, method)(*args, **kwargs)
    return result if rank == 0 else None


def _worker(rank: int, world_size: int, port: int, model_path: str, cfg: TrainerConfig, dtype: str, seed: int,
            conn, threads: int) -> None:
    try:
        trainer = start_rank(rank, world_size, ("127.0.0.1", port), model_path, cfg, dtype, seed, threads)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == "close":
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", run_call(trainer, rank, method, args, kwargs, _PipeSink(conn))))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    try:
        trainer.close()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


class SpawnedTrainer:
    """`MegatronTrainer` over `world_size` child processes (gloo on CPU, NCCL on GPU)."""

    def __init__(self, model_path: str | os.PathLike, cfg: TrainerConfig | None = None, world_size: int = 2,
                 timeout_s: float | None = None, threads_per_rank: int | None = None, *, dtype: str = "auto",
                 seed: int = 1234) -> None:
        import torch.multiprocessing as mp

        self.cfg = cfg or TrainerConfig()
        self.world_size = world_size
        self.timeout_s = self.cfg.call_timeout_s if timeout_s is None else timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._conns, self._procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            # not daemonic: a rank starts processes of its own (Megatron-Core's checkpoint writers); a rank whose
            # driver is gone reads EOF on its pipe and exits, and `close` runs at the driver's exit (atexit)
            p = ctx.Process(target=_worker, args=(r, world_size, port, str(model_path), self.cfg, dtype, seed, child, threads),
                            daemon=False)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        atexit.register(self.close, force=True)
        try:
            self._replies()
        except BaseException:
            self.close(force=True)
            raise

    # -------------------------------------------------------------------------------------------- plumbing

    def _recv(self, rank: int) -> Any:
        conn, proc = self._conns[rank], self._procs[rank]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not proc.is_alive():
                raise RuntimeError(f"trainer rank {rank} exited (code {proc.exitcode}) without replying")
            if waited > self.timeout_s:
                raise TimeoutError(f"trainer rank {rank} gave no reply within {self.timeout_s:.0f} s")
        return conn.recv()

    def _replies(self, sink=None) -> Any:
        result, errors = None, []
        for r in range(self.world_size):
            while True:
                msg = self._recv(r)
                kind = msg[0]
                if kind == "begin":
                    if sink is not None:
                        sink.begin(msg[1])
                elif kind == "bucket":
                    bucket = _unpack(*msg[1])
                    if sink is not None:
                        sink.push(bucket)
                    self._conns[r].send("ack")
                elif kind == "end":
                    if sink is not None:
                        sink.end(msg[1])
                else:
                    break
            if kind == "error":
                errors.append(f"rank {r}:\n{msg[1]}")
            elif r == 0:
                result = msg[1]
        if errors:
            raise RuntimeError("trainer rank failed:\n" + "\n".join(errors))
        return result

    def _call(self, method: str, *args, _sink=None, **kwargs) -> Any:
        for c in self._conns:
            c.send((method, args, kwargs))
        return self._replies(_sink)

    # -------------------------------------------------------------------------------------------- API

    def compute_logprobs(self, batch, *, replay: bool | None = None, temperature: float = 1.0):
        return self._call("compute_logprobs", list(batch), replay=replay, temperature=temperature)

    def train_step(self, batch, *, temperature: float = 1.0) -> dict[str, float]:
        return self._call("train_step", list(batch), temperature=temperature)

    def loss_on(self, batch, old_logprobs, *, temperature: float = 1.0) -> dict[str, float]:
        return self._call("loss_on", list(batch), old_logprobs, temperature=temperature)

    def sync_weights(self, sink, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        from megatron_bridge.weight_sync import CallableSink, WeightSink

        if not isinstance(sink, WeightSink):
            sink = CallableSink(sink)
        return self._call("sync_weights", version, bucket_bytes, dtype, _sink=sink)

    def send_weights(self, spec, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        """The ranks stream the weights to the servers themselves (`MegatronTrainer.send_weights`)."""
        return self._call("send_weights", spec, version, bucket_bytes, dtype)

    def offload(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict[str, float]:
        """Every rank releases the device memory of `kinds` (`MegatronTrainer.offload`); rank 0's bytes."""
        return self._call("offload", tuple(kinds))

    def reload(self, kinds: tuple[str, ...] | None = None) -> dict[str, float]:
        """Every rank brings back what `offload` released (`MegatronTrainer.reload`)."""
        return self._call("reload", kinds)

    def iter_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Materialises the export in the driver, then yields it (the ranks stream it bucket by bucket)."""
        return iter(self.export_hf_state(dtype=dtype).items())

    def export_hf_state(self, out_dir=None, dtype: torch.dtype | None = None):
        if out_dir is not None:
            return self._call("export_hf_state", str(out_dir), dtype)
        from megatron_bridge.weight_sync import InMemorySink

        sink = InMemorySink()
        self._call("iter_hf_tensors", _sink=sink, dtype=dtype)
        return sink.state

    def save_checkpoint(self, ckpt_dir) -> Any:
        return self._call("save_checkpoint", str(ckpt_dir))

    def load_checkpoint(self, ckpt_dir) -> None:
        return self._call("load_checkpoint", str(ckpt_dir))

    def close(self, force: bool = False) -> None:
        atexit.unregister(self.close)
        for c in self._conns:
            try:
                if force:
                    c.close()  # a rank waiting for a call reads EOF and exits
                else:
                    c.send(("close", (), {}))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=0.5 if force else 10.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []

    def __enter__(self) -> SpawnedTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_trainer(model_path, cfg: TrainerConfig | None = None, world_size: int = 1, *, dtype: str = "auto",
                 seed: int = 1234, **kwargs):
    """World size 1: `MegatronTrainer` in this process; more: `SpawnedTrainer` (same methods)."""
    if world_size == 1:
        from megatron_bridge.trainer import MegatronTrainer

        return MegatronTrainer(model_path, cfg, dtype=dtype, seed=seed)
    return SpawnedTrainer(model_path, cfg, world_size, dtype=dtype, seed=seed, **kwargs)
