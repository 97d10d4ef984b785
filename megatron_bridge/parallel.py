"""Process groups: torch.distributed (gloo on CPU, NCCL on GPU) plus Megatron-Core's parallel_state.

The trainer is SPMD: every rank runs the same `MegatronTrainer` method with the same arguments. World size 1
runs in the caller's process (`init_parallel` creates a one-rank group on a free local port); world size > 1
either comes from torchrun (environment variables already set) or from `spawn()`, which the tests and the
spawned trainer use.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge import cpu_compat


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout; data parallelism is whatever the world size leaves over."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    etp: int = 1  # expert tensor parallelism; 1 keeps each expert whole on one rank
    cp: int = 1  # context parallelism: every packed sequence split over cp ranks

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def check(self, world_size: int) -> int:
        """Validate against `world_size`; returns the data-parallel size."""
        for name in ("tp", "ep", "pp", "etp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {mp}")
        dp = world_size // mp
        if (self.tp * self.cp * dp) % (self.ep * self.etp):
            raise ValueError(f"ep*etp = {self.ep * self.etp} must divide tp*cp*dp = {self.tp * self.cp * dp}")
        return dp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_cpu(device: str | None = None) -> bool:
    return cpu_compat.needed(device)


def init_parallel(
    cfg: ParallelConfig,
    *,
    device: str | None = None,
    seed: int = 1234,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Initialise torch.distributed (if needed) and Megatron-Core's model-parallel groups and RNG tracker.

    gloo on CPU, NCCL on GPU. Without torchrun-style environment variables this is a one-rank group.
    """
    import datetime

    from megatron.core import parallel_state, tensor_parallel

    cpu = use_cpu(device)
    if cpu:
        cpu_compat.activate()
    else:
        cpu_compat.patch_missing_te()
    if parallel_state.model_parallel_is_initialized():
        if dist.is_initialized() and dist.get_world_size() == 1:
            # Megatron's destroy_model_parallel forgets its gloo groups without destroying them (each keeps its
            # threads); a one-rank default group is rebuilt in milliseconds, and destroying it ends them all
            destroy_parallel()
        else:
            parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError("MASTER_PORT must be set for world size > 1 (spawn() sets it)")
            os.environ["MASTER_PORT"] = str(free_port())
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        dist.init_process_group(
            backend="gloo" if cpu else "nccl",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    cfg.check(dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
        context_parallel_size=cfg.cp,
        create_gloo_process_groups=True,
        distributed_timeout_minutes=max(1, round(timeout_s / 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_parallel() -> None:
    """Tear down Megatron-Core's groups and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        # plain pickle bytes, not torch's fd-sharing reductions: a rank may exit before the parent reads
        # its tensors, and a shared fd then no longer exists (FileNotFoundError in the parent).
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_parallel()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; return their results by rank.

    The environment for `init_parallel` is set (a free port per call). Any rank's exception is re-raised here
    with its traceback; a rank that hangs past `timeout_s` is killed and reported, never waited on forever.
    `fn` and its results must be picklable (module-level function; tensors are fine).
    """
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry, args=(r, world_size, port, fn, args, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"spawned ranks did not finish within {timeout_s:.0f} s "
                                   f"(finished: {sorted(results)})")
            try:
                rank, ok, value = q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(results) + len(errors) < world_size:
                    # give a crashed rank's siblings a moment to report, then fail
                    try:
                        rank, ok, value = q.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise RuntimeError(
                            f"rank process exited with code {dead[0].exitcode} without a result") from None
                else:
                    continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("spawned rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
