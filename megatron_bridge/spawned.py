"""`PipeRanks`: N trainer ranks in child processes on this machine, the local launcher's `RankGroup`.

The driver (the loop's process) sends each call to every rank over a pipe and returns rank 0's answer
(`megatron_bridge.proxy.TrainerProxy` gives it `MegatronTrainer`'s methods). Weight sync streams rank 0's buckets
back over the pipe (as `torch.save` bytes for CPU tensors, as CUDA IPC handles for GPU tensors) and feeds the
driver's sink, so the sink object (an SGLang client, a disk folder) stays in the driver. Any rank's exception is
re-raised in the driver with its traceback; a rank that dies or stalls past `timeout_s` fails the call instead
of hanging it, as `RankFailure`. The driver waits on every rank's pipe and process at once, so a rank's death is
seen within milliseconds even while the others are blocked in a collective with it (they are killed at `close`).
A rank process exits when the driver is gone (`rank_faults.rank_process` watches it first). `start_rank` and
`run_call` are the rank side that both launchers' rank processes share.
"""

from __future__ import annotations

import atexit
import io
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from megatron_bridge.config import TrainerConfig
from megatron_bridge.parallel import free_port
from megatron_bridge.proxy import RankFailure, TrainerProxy
from megatron_bridge.rank_faults import arm, rank_process


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


RankSetup = Callable[[], None]  # run first in every rank process (a module-level function: it is pickled)


def start_rank(rank: int, world_size: int, master: tuple[str, int], model_path: str, cfg: TrainerConfig, dtype: str,
               seed: int, threads: int, local_rank: int | None = None, setup: RankSetup | None = None):
    """One trainer rank in this process: `setup()` (e.g. the application's warning filters: each rank is a fresh
    process that the driver's do not reach), the torch.distributed rendezvous at `master` (address, port) and its
    `MegatronTrainer`. `local_rank` is the GPU it uses (default: `rank`). Shared by both launchers' rank
    processes (the local child processes here, megatron_bridge.ray_trainer's actors)."""
    os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank if local_rank is None else local_rank))
    torch.set_num_threads(threads)
    if setup is not None:
        setup()
    from megatron_bridge.trainer import MegatronTrainer

    trainer = MegatronTrainer(model_path, cfg, dtype=dtype, seed=seed)
    arm(trainer, rank)  # the fault-injection test hook (ROLLVERIFY_RANK_FAULTS); nothing without it
    return trainer


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


def rank_loop(rank: int, world_size: int, port: int, model_path: str, cfg: TrainerConfig, dtype: str, seed: int,
              conn, threads: int, setup: RankSetup | None) -> None:
    """One local rank process: its trainer, then the driver's calls over `conn` until close or EOF."""
    try:
        trainer = start_rank(rank, world_size, ("127.0.0.1", port), model_path, cfg, dtype, seed, threads,
                             setup=setup)
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
            reply = ("ok", run_call(trainer, rank, method, args, kwargs, _PipeSink(conn)))
        except BaseException:  # noqa: BLE001
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:  # the driver closed the group (a rank failed): nothing to report to
            break
    try:
        trainer.close()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


class PipeRanks:
    """`world_size` `MegatronTrainer` ranks in child processes (gloo on CPU, NCCL on GPU)."""

    def __init__(self, model_path: str | os.PathLike, cfg: TrainerConfig | None = None, world_size: int = 2,
                 timeout_s: float | None = None, threads_per_rank: int | None = None, *, dtype: str = "auto",
                 seed: int = 1234, setup: RankSetup | None = None) -> None:
        import torch.multiprocessing as mp

        cfg = cfg or TrainerConfig()
        self.world_size = world_size
        self.timeout_s = cfg.call_timeout_s if timeout_s is None else timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._conns, self._procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            # not daemonic: a rank starts processes of its own (Megatron-Core's checkpoint writers); a rank whose
            # driver is gone reads EOF on its pipe and exits, and `close` runs at the driver's exit (atexit)
            p = ctx.Process(target=rank_process, daemon=False,
                            args=(f"{__name__}:rank_loop", r, world_size, port, str(model_path), cfg, dtype, seed,
                                  child, threads, setup))
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        atexit.register(self.close, force=True)
        try:
            self._replies("start")
        except BaseException:
            self.close(force=True)
            raise

    # -------------------------------------------------------------------------------------------- plumbing

    def _wait(self, rank: int, method: str) -> None:
        """Until rank `rank` has a message; `RankFailure` at once when any rank's process is gone, or after
        `timeout_s` of silence."""
        from multiprocessing.connection import wait

        conn = self._conns[rank]
        deadline = time.monotonic() + self.timeout_s
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while not conn.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(rank, method, "silent", f"no reply within {self.timeout_s:.0f} s "
                                  "(trainer.call_timeout_s)")
            ready = wait([conn, *sentinels], timeout=min(left, 5.0))
            dead = [r for r, p in enumerate(self._procs) if p.sentinel in ready or not p.is_alive()]
            if dead and not conn.poll():
                r = dead[0]
                self._procs[r].join(1.0)
                raise RankFailure(r, method, "died", f"exit code {self._procs[r].exitcode}")

    def _recv(self, rank: int, method: str) -> Any:
        self._wait(rank, method)
        try:
            return self._conns[rank].recv()
        except (EOFError, OSError):  # it died after its last message
            self._procs[rank].join(1.0)
            raise RankFailure(rank, method, "died", f"exit code {self._procs[rank].exitcode}") from None

    def _replies(self, method: str, sink=None) -> Any:
        result, errors = None, []
        for r in range(self.world_size):
            while True:
                msg = self._recv(r, method)
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
                errors.append((r, msg[1]))
            elif r == 0:
                result = msg[1]
        if errors:
            r, trace = errors[0]
            raise RankFailure(r, method, "error", "\n".join(f"rank {q}:\n{t}" for q, t in errors))
        return result

    def call(self, method: str, args: tuple, kwargs: dict, sink=None) -> Any:
        return self.call_each(method, [(args, kwargs)] * self.world_size, sink)

    def call_each(self, method: str, per_rank: list[tuple[tuple, dict]], sink=None) -> Any:
        for r, (c, (args, kwargs)) in enumerate(zip(self._conns, per_rank, strict=True)):
            try:
                c.send((method, args, kwargs))
            except (BrokenPipeError, OSError):
                self._procs[r].join(1.0)
                raise RankFailure(r, method, "died", f"exit code {self._procs[r].exitcode}") from None
        return self._replies(method, sink)

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


def spawn_trainer(model_path: str | os.PathLike, cfg: TrainerConfig | None = None, world_size: int = 2,
                  timeout_s: float | None = None, threads_per_rank: int | None = None, *, dtype: str = "auto",
                  seed: int = 1234, setup: RankSetup | None = None) -> TrainerProxy:
    """`MegatronTrainer`'s methods over `world_size` child-process ranks (`PipeRanks`)."""
    return TrainerProxy(PipeRanks(model_path, cfg, world_size, timeout_s, threads_per_rank, dtype=dtype, seed=seed,
                                  setup=setup))


def make_trainer(model_path, cfg: TrainerConfig | None = None, world_size: int = 1, *, dtype: str = "auto",
                 seed: int = 1234, setup: RankSetup | None = None, **kwargs):
    """World size 1: `MegatronTrainer` in this process (the driver's own, which `setup` is for, is set up
    already); more: `spawn_trainer` (same methods)."""
    if world_size == 1:
        from megatron_bridge.trainer import MegatronTrainer

        return MegatronTrainer(model_path, cfg, dtype=dtype, seed=seed)
    return spawn_trainer(model_path, cfg, world_size, dtype=dtype, seed=seed, setup=setup, **kwargs)
