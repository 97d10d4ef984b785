"""Trainer checkpoints in Megatron-Core's distributed checkpoint format, loadable under another parallel layout.

A checkpoint folder holds Megatron-Core's `torch_dist` files (`dist_checkpointing.save`: every rank writes its
own shards, keyed by the global tensor, so any TP / PP / EP / DP layout can read them back) and
`rollverify_trainer.json` (the model's architecture, the layout and world size that wrote it, the model path,
the step). What is saved:

* the model's weights (`GPTModel.sharded_state_dict`: TP shards, fused QKV by query group, SwiGLU halves, experts
  by global index, layers by global index);
* the optimizer: the fp32 main parameters and Adam moments in Megatron-Core's `fully_reshardable` format (each
  tensor the shape of its parameter, so it reshards like the weights; the distributed optimizer gathers its DP
  shards to do so), and its param groups (step, LR);
* the LR scheduler, the trainer's step count and weight version (common state, written once).

Host memory. The save uses Megatron-Core 0.16.1's memory-efficient exchange
(`distrib_optim_fully_reshardable_mem_efficient`, megatron/core/optimizer/distrib_optimizer.py): the optimizer
state is gathered with gloo on each data-parallel group's rank 0 only, which holds its model-parallel shard's
whole state in host memory (fp32 param + two moments: 12 bytes per parameter of the TP/PP/EP shard) and writes
it; without the option every DP rank would gather it (all-gather) and hold the same. A load fills that whole
state on every rank (Megatron-Core's loading format), and reads it in parallel: Megatron-Core's
`FullyParallelLoadStrategyWrapper` over the data-parallel group has each rank read a share of the files and the
ranks exchange the rest, so the storage serves each byte once per group instead of once per rank.
`rollverify.app.host_memory` counts these bytes per node for `rollverify plan`.

Loading reads `rollverify_trainer.json` first: a checkpoint of another model fails there, naming each field that
differs, before any tensor is read. A layout that differs from the writer's is fine.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.model import ModelArch, unwrap

META_FILE = "rollverify_trainer.json"
FORMAT = "megatron-core dist_checkpointing (torch_dist), optimizer fully_reshardable"
# the memory-efficient exchange: gloo gather on DP rank 0 only (the format on disk reads back either way)
_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's description; a clear error when the folder is not a trainer checkpoint of this format."""
    d = Path(ckpt_dir)
    f = d / META_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{d} is not a trainer checkpoint: it has no {META_FILE}")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{d} is a trainer checkpoint of format {meta.get('format', 'per-rank torch.save')!r}; "
                         f"this trainer reads {FORMAT!r} (re-export the weights with export_hf_state and start "
                         f"from them)")
    return meta


def check_model(meta: dict[str, Any], arch: ModelArch, ckpt_dir: str | Path) -> None:
    """Refuse a checkpoint written for another architecture, naming every field that differs."""
    here = asdict(arch)
    saved = meta.get("arch", {})
    diff = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
    if diff:
        raise ValueError(f"checkpoint {ckpt_dir} is of another model ({meta.get('model_path')}): "
                         + "; ".join(f"{k} {a} in the checkpoint, {b} here" for k, (a, b) in diff.items()))


def _sharded_state(model, optimizer, is_loading: bool) -> dict[str, Any]:
    module = unwrap(model)
    model_state = module.sharded_state_dict(metadata=_SHARDING)
    optim_state = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=_SHARDING)
    return {"model": model_state, "optimizer": _without_empty_param_state(optim_state)}


def _without_empty_param_state(state: Any) -> Any:
    """The memory-efficient exchange leaves `param_state` None on every rank but a group's DP rank 0 (which holds
    it as sharded tensors); dropped, so the ranks' common state agrees."""
    if isinstance(state, dict):
        return {k: _without_empty_param_state(v) for k, v in state.items() if not (k == "param_state" and v is None)}
    return state


def save(ckpt_dir: str | Path, model, optimizer, scheduler, *, arch: ModelArch, parallel: dict[str, int],
         model_path: str, step: int, version: int) -> Path:
    """Collective: every rank writes its shards into `ckpt_dir` (created), rank 0 the common state and meta.
    Each rank first reserves the space it will write; a rank that cannot (disk full, no permission) makes every
    rank raise the same OSError at once (`_agreed`), with nothing of the checkpoint's shards written."""
    from megatron.core import dist_checkpointing

    d = Path(ckpt_dir)

    def start() -> None:
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
            (d / META_FILE).unlink(missing_ok=True)  # a folder without its meta is never taken for a checkpoint

    _agreed(start)
    state = _sharded_state(model, optimizer, is_loading=False)
    state.update(scheduler=scheduler.state_dict(), step=step, version=version)
    _agreed(lambda: _reserve(d, _bytes_to_write(state)))

    def write() -> None:
        with _in_process_write_results():
            dist_checkpointing.save(state, str(d))

    _agreed(write)

    def finish() -> None:
        if dist.get_rank() == 0:
            meta = {"format": FORMAT, "world_size": dist.get_world_size(), "parallel": parallel,
                    "arch": asdict(arch), "model_path": model_path, "step": step, "version": version}
            (d / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")

    _agreed(finish)
    return d


def _agreed(fn) -> None:
    """Collective: run `fn` on every rank; if it raised OSError on any, raise it on all (naming the rank), so
    that a rank whose disk is full or read-only does not leave the others waiting in the next collective until
    `dist_timeout_s`. (A rank that fails inside Megatron-Core's own collectives still makes the others wait.)"""
    error = None
    try:
        fn()
    except OSError as e:
        error = (e.errno, f"rank {dist.get_rank()}: {e.strerror or e}", e.filename)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise OSError(first[0], f"checkpoint not written: {first[1]}", first[2])


def _bytes_to_write(state: dict[str, Any]) -> int:
    """What this rank writes of `state`: the local data of the tensors whose main replica it holds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    total = 0
    for v in nested_values(state):
        if isinstance(v, ShardedTensor) and is_main_replica(v.replica_id) and isinstance(v.data, torch.Tensor):
            total += v.data.numel() * v.data.element_size()
    return total


def _reserve(d: Path, nbytes: int) -> None:
    """Allocate what this rank is about to write (and a margin) in `d`, then free it: a full disk or a folder
    that cannot be written fails here, before any shard is written, on every rank at once (`_agreed`)."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / f".reserve-{dist.get_rank()}"
    try:
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, int(nbytes * 1.05) + (1 << 20))
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """Megatron-Core's writer returns a save's write results through a multiprocessing Manager queue (meant for
    its asynchronous save); the Manager's server process imports torch to unpickle them, 25 s on a loaded CPU
    machine for each rank's first save. This save is synchronous (results put and read in this process), so a
    plain in-process queue serves for its duration."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._get_write_results_queue
    results: queue.Queue = queue.Queue()
    filesystem_async._get_write_results_queue = lambda: results
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = original


def load(ckpt_dir: str | Path, model, optimizer, scheduler, *, arch: ModelArch) -> tuple[int, int]:
    """Collective: load weights, optimizer and scheduler saved under any layout; returns (step, version)."""
    from megatron.core import dist_checkpointing

    d = Path(ckpt_dir)
    check_model(read_meta(d), arch, d)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        _init_state(part)
    state = _sharded_state(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, str(d), sharded_strategy=parallel_load_strategy(d))
    unwrap(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    return int(loaded["step"]), int(loaded["version"])


def parallel_load_strategy(ckpt_dir: str | Path):
    """Megatron-Core's load strategy for `ckpt_dir`, its reads spread over the data-parallel group (with context
    parallelism: the ranks that hold the same model-parallel shard) and exchanged there."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(ckpt_dir)), group)


def _init_state(part) -> None:
    """Give an optimizer that has not stepped yet the state its first step would create, so that Megatron-Core
    can describe it for loading (the loaded values then replace it; stepping from it equals a fresh step).

    torch's Adam (Megatron-Core's without TE / apex): step 0 and zero moments (its distributed optimizer reads the
    step from the per-parameter state and asserts there is one). torch's SGD: zero momentum buffers (with no
    dampening the first step from them equals the first step without them); Megatron-Core has no state
    initialiser for SGD and calls it unconditionally when loading.
    """
    inner = part.optimizer
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and not inner.state:
        for p in _params(inner):
            inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    if part.init_state_fn is None:
        part.init_state_fn = _init_sgd_momentum


def _init_sgd_momentum(inner, config=None) -> None:
    if isinstance(inner, torch.optim.SGD):
        for group in inner.param_groups:
            if group["momentum"] and not group["dampening"]:
                for p in group["params"]:
                    inner.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def _params(inner) -> list:
    return [p for group in inner.param_groups for p in group["params"]]
