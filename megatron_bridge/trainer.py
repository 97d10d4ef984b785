"""`MegatronTrainer`: the Megatron-Core side of the loop (log-probs, GRPO step, export, checkpoints).

SPMD: every rank constructs the trainer and calls each method; a batch arrives whole (every rank takes its
data-parallel share itself) or already cut by the driver into this rank's `BatchShare` (`TrainerProxy`: each rank
receives only its share), and the full result comes back on every rank. World size 1 runs in
the caller's process; `megatron_bridge.proxy.TrainerProxy` gives N ranks elsewhere (child processes or Ray
actors) the same methods, so the loop's driver stays a plain sequence of calls.

Micro-batches go through Megatron-Core's forward-backward schedule (pipeline parallelism for free) with
`calculate_per_token_loss`: each micro-batch returns its summed token loss and token count, and Megatron divides
the gradients by the token count of the whole mini-batch over micro-batches and data-parallel ranks, which is
the design's token-mean (never the sum of TIS weights).

The trainer composes one rank's parts: `MicroBatchRunner` (micro_batches.py: the DP share, micro-batches, the
schedule, results over ranks), `WeightsOut` (weights_out.py: HF export, sync, transport send) and
`TrainerMemory` (offload.py: the colocated memory handoff); each public method is a call the spawned and Ray
launchers dispatch by name to every rank.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_bridge import checkpoint, convert, policy_loss
from megatron_bridge.batch import BatchLayout, BatchShare, RankBatch, TrainSequence, check_batch, rank_batch
from megatron_bridge.config import TrainerConfig
from megatron_bridge.logprobs import defer_output_layer
from megatron_bridge.micro_batches import MicroBatchRunner
from megatron_bridge.model import (
    UnsupportedCheckpoint,
    build_model,
    check_layout,
    recompute_options,
    transformer_config,
)
from megatron_bridge.offload import KINDS, TrainerMemory
from megatron_bridge.parallel import ParallelConfig, init_parallel, use_cpu
from megatron_bridge.replay import check_all_routes
from megatron_bridge.throughput import log_once, probe, select_paths
from megatron_bridge.weights_out import WeightsOut
from megatron_bridge.wrap import make_optimizer, wrap_ddp


def resolve_device(device: str) -> str:
    """`TrainerConfig.device` on this machine: auto is what the run configured (`rollverify.devices.DEVICE_ENV`,
    set by its launcher), else cuda where a GPU is visible, else cpu. CUDA that this process cannot use stops it
    here (`CudaUnavailable`: the node, the driver torch needs, the fix), before any process group or model."""
    from rollverify.devices import configured_device, require_cuda

    if device == "auto":
        device = configured_device() or ("cpu" if use_cpu() else "cuda")
    if device == "cuda":
        require_cuda()
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`ModelConfig.dtype` for the trainer on `device`: auto is float32 on CPU and bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _needs(*kinds: str) -> Callable:
    """The method runs with `kinds` of the trainer's memory on the device (`TrainerMemory.resident`)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            with self.memory.resident(kinds):
                return fn(self, *args, **kwargs)

        return call

    return wrap


class MegatronTrainer:
    """One rank of the trainer. See the module docstring for the SPMD contract."""

    def __init__(self, model_path: str | os.PathLike, cfg: TrainerConfig | None = None, *, dtype: str = "auto",
                 seed: int = 1234) -> None:
        """`cfg` is the run config's trainer section; `dtype` its model's (auto: float32 on CPU, bfloat16 on
        GPU), `seed` its seed."""
        self.cfg = cfg = cfg or TrainerConfig()
        self.model_path = Path(model_path)
        self.arch = convert.check_checkpoint(self.model_path)  # unsupported / mismatched: fail before building
        self.device = torch.device(resolve_device(cfg.device))
        self.dtype = resolve_dtype(dtype, self.device.type)
        # the section's own rules are TrainerConfig.check's, run when the run config is validated; what only the
        # checkpoint or the world size tells is checked here (and by ParallelConfig)
        if self.arch.moe and cfg.tp > 1 and (not cfg.sequence_parallel or cfg.ep * cfg.etp == 1):
            # Megatron-Core trains MoE under TP only with sequence parallelism. With ep == etp == 1 the whole
            # experts would be copies on every TP rank, each seeing its own tokens, and Megatron-Core reduces
            # expert gradients over TP only for expert-parallel or expert-tensor-parallel weights
            raise UnsupportedCheckpoint(f"MoE with tp={cfg.tp} > 1 needs sequence_parallel=True and ep > 1 or "
                                        f"etp > 1 (got sequence_parallel={cfg.sequence_parallel}, ep={cfg.ep}, "
                                        f"etp={cfg.etp})")
        check_layout(self.arch, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp, etp=cfg.etp)
        recompute_options(cfg.recompute, self.arch.moe)  # a bad value fails here, before any process group
        self.pcfg = ParallelConfig(tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp, etp=cfg.etp)
        init_parallel(self.pcfg, device=self.device.type, seed=seed, timeout_s=cfg.dist_timeout_s)
        self.layout = convert.Layout.current()
        self.paths = select_paths(probe(self.device.type), moe=self.arch.moe,
                                  distributed_optimizer=cfg.use_distributed_optimizer)
        log_once(self.paths)
        self.tconfig = transformer_config(self.arch, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp, etp=cfg.etp,
                                          dtype=self.dtype, recompute=cfg.recompute,
                                          sequence_parallel=cfg.sequence_parallel, paths=self.paths)
        self.tconfig.calculate_per_token_loss = True
        model = build_model(self.arch, self.tconfig)
        if self.device.type == "cuda":
            model.cuda(torch.cuda.current_device())
        convert.load_hf_checkpoint(model, self.model_path, self.arch, self.layout)
        defer_output_layer(model)
        self.model = wrap_ddp(model, self.tconfig, cfg, self.dtype, self.paths)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg, self.dtype, self.paths)
        self.micro = MicroBatchRunner(cfg, self.arch, self.layout, self.model, self.device)
        self.weights = WeightsOut(self.model, self.arch, self.layout, self.model_path)
        self.memory = TrainerMemory(self.model, self.optimizer)
        self.step_count = 0
        self.version = 0

    # ------------------------------------------------------------------------------------------ log-probs

    def batch_layout(self) -> BatchLayout:
        """What a driver needs to cut a batch for the ranks and check it first (collective: every rank's DP rank)."""
        ranks = [self.micro.dp_rank] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if len(ranks) > 1:
            torch.distributed.all_gather_object(ranks, self.micro.dp_rank)
        a, c = self.arch, self.cfg
        return BatchLayout(self.micro.dp, tuple(ranks), a.moe, c.replay_train, c.replay_verify, c.correction.weighting,
                           c.max_seq_len, a.context_length, a.vocab_size, a.num_layers, a.top_k, a.num_experts)

    def _checked(self, batch: Sequence[TrainSequence] | BatchShare, use_replay: bool) -> RankBatch:
        seqs = rank_batch(batch, self.micro.dp, self.micro.dp_rank)
        check_batch(seqs, max_seq_len=self.cfg.max_seq_len, context_length=self.arch.context_length,
                    vocab_size=self.arch.vocab_size)
        if use_replay:
            check_all_routes(seqs, self.arch.num_layers, self.arch.top_k, self.arch.num_experts)
        return seqs

    def _logprobs(self, seqs: list[TrainSequence], use_replay: bool, temperature: float) -> tuple[list, list]:
        mbs = self.micro.build(seqs, use_replay)

        def loss_of_mb(mb, output):
            lp, ent = self.micro.token_stats(mb, output, temperature)
            rec = {"seq_index": mb.seq_index, "counts": mb.gen_counts,
                   "lp": lp.detach().float().cpu(), "ent": ent.detach().float().cpu()}
            return torch.zeros((), device=output.device), torch.tensor(0, dtype=torch.int), rec

        self.model.eval()
        with torch.no_grad():
            results = self.micro.share_results(self.micro.run(mbs, loss_of_mb, forward_only=True))
        lps: list[Any] = [None] * len(seqs)
        ents: list[Any] = [None] * len(seqs)
        for rec in results:
            for i, a, b in zip(rec["seq_index"], rec["lp"].split(rec["counts"]), rec["ent"].split(rec["counts"]),
                               strict=True):
                lps[i], ents[i] = a.numpy(), b.numpy()
        return lps, ents

    @_needs("params")
    def compute_logprobs(self, batch: Sequence[TrainSequence], *, replay: bool | None = None,
                         temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Log-probs (temperature-scaled, as the engine reports them) and entropies of every generated token,
        flat float32 in batch order. `replay` defaults to `replay_verify` (this is the verification forward)."""
        use_replay = (self.cfg.replay_verify if replay is None else replay) and self.arch.moe
        seqs = self._checked(batch, use_replay)
        if not seqs:
            return np.zeros(0, np.float32), np.zeros(0, np.float32)
        lps, ents = self._logprobs(seqs, use_replay, temperature)
        return np.concatenate(lps).astype(np.float32), np.concatenate(ents).astype(np.float32)

    @_needs("params")
    def old_logprobs(self, batch: Sequence[TrainSequence], *, temperature: float = 1.0) -> np.ndarray:
        """The old log-probs `train_step` recomputes first (same routing as the training forward), flat float32 in
        batch order: computed ahead (the asynchronous schedule verifies with them) and handed back to the step."""
        use_replay = self.cfg.replay_train and self.arch.moe
        seqs = self._checked(batch, use_replay)
        if not seqs:
            return np.zeros(0, np.float32)
        lps, _ = self._logprobs(seqs, use_replay, temperature)
        return np.concatenate(lps).astype(np.float32)

    # ------------------------------------------------------------------------------------------ train

    @_needs(*KINDS)
    def train_step(self, batch: Sequence[TrainSequence], *, temperature: float = 1.0,
                   policy_version: int | None = None, old_logprobs: np.ndarray | None = None) -> dict[str, float]:
        """One optimizer step of the GRPO loss on `batch` (sequences with advantages and rollout log-probs).
        `policy_version`: the version of the weights held now, which splits the engine/trainer mismatch from
        the drift of older tokens (`policy_loss.mismatch`).

        The old log-probs of the ratio are recomputed here, before the step, with the same routing as the
        training forward (or taken from `old_logprobs`: what `old_logprobs` returned for this batch at these
        weights, flat), and feed TIS: `w = min(exp(lp_old_train - lp_rollout), C)` (detached).
        """
        t0 = time.perf_counter()
        seqs = rank_batch(batch, self.micro.dp, self.micro.dp_rank)
        if not seqs:
            raise ValueError("train_step needs at least one sequence")
        for i, s in enumerate(seqs):
            if s is None:  # another data-parallel rank's
                continue
            if s.advantage is None:
                raise ValueError(f"sequence {i} has no advantage")
        policy_loss.check_rollout_logprobs(seqs, self.cfg.correction.weighting)
        use_replay = self.cfg.replay_train and self.arch.moe
        seqs = self._checked(seqs, use_replay)
        if old_logprobs is None:
            old, _ = self._logprobs(seqs, use_replay, temperature)
        else:
            counts = seqs.gen_counts  # every sequence's, this rank's share or not: the array is the whole batch's
            flat = np.asarray(old_logprobs, np.float32).reshape(-1)
            if flat.size != sum(counts):
                raise ValueError(f"old_logprobs: {flat.size} values for {sum(counts)} generated tokens (one each)")
            old = np.split(flat, np.cumsum(counts)[:-1])
        t_old = time.perf_counter() - t0

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.cfg.correction.masks_offpolicy and policy_version is None:
            raise ValueError("trainer.correction mask_offpolicy needs the policy_version of train_step (the weights "
                             "held now)")
        metrics = self._loss_pass(seqs, old, use_replay, temperature, forward_only=False,
                                  policy_version=policy_version)
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step_count += 1
        metrics.update(policy_loss.mismatch(seqs, old, policy_version,
                                            None if seqs.whole else self.micro.share_results))
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            update_ok=float(bool(ok)),
            lr=lr,
            step=float(self.step_count),
            time_old_logprob_s=t_old,
            time_step_s=time.perf_counter() - t0,
        )
        return metrics

    def _loss_pass(self, seqs: list[TrainSequence], old: list, use_replay: bool, temperature: float,
                   forward_only: bool, policy_version: int | None = None) -> dict[str, float]:
        mbs = self.micro.build(seqs, use_replay)
        corr = self.cfg.correction
        older = policy_version if corr.masks_offpolicy else None
        for mb in mbs:
            mb.extras = policy_loss.loss_inputs(seqs, mb, old, corr.reads_rollout_logprobs, mask_older_than=older)

        def loss_of_mb(mb, output):
            lp, ent = self.micro.token_stats(mb, output, temperature)
            return policy_loss.micro_batch_loss(lp, ent, mb.extras, mb.gen_counts, self.cfg)

        if forward_only:
            with torch.no_grad():
                return self.micro.reduce_metrics(self.micro.run(mbs, loss_of_mb, forward_only=True))
        return self.micro.reduce_metrics(self.micro.run(mbs, loss_of_mb, forward_only=False))

    @_needs("params")
    def loss_on(self, batch: Sequence[TrainSequence], old_logprobs: np.ndarray, *,
                temperature: float = 1.0) -> dict[str, float]:
        """The train-step loss and its statistics on `batch` at the current weights, without a step; the
        ratio's denominator is `old_logprobs` (flat, as `compute_logprobs` returns them)."""
        use_replay = self.cfg.replay_train and self.arch.moe
        seqs = self._checked(batch, use_replay)
        counts = seqs.gen_counts
        old = np.split(np.asarray(old_logprobs, np.float32), np.cumsum(counts)[:-1])
        self.model.eval()
        return self._loss_pass(seqs, old, use_replay, temperature, forward_only=True)

    # ------------------------------------------------------------------------------------------ memory handoff

    def offload(self, kinds: Sequence[str] = KINDS) -> dict[str, float]:
        """Release the device memory of `kinds` (params, grads, optimizer) until `reload`; a call that needs
        them in between brings them back for its duration (`megatron_bridge.offload`)."""
        return self.memory.offload(kinds)

    def reload(self, kinds: Sequence[str] | None = None) -> dict[str, float]:
        """Bring back what `offload` released (default: all of it), bit for bit."""
        return self.memory.reload(kinds)

    def memory_report(self) -> dict[str, int]:
        """This rank's GPU memory as CUDA reports it (allocated by torch, free and total on the device); {} off
        CUDA. The driver holds it against its ledger (rollverify.app.gpu_memory)."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        return {"allocated": torch.cuda.memory_allocated(self.device), "free": free, "total": total}

    # ------------------------------------------------------------------------------------------ export / sync

    def iter_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time, on every rank (collective: all ranks iterate together)."""
        with self.memory.resident(("params",)):
            yield from self.weights.iter_hf_tensors(dtype)

    @_needs("params")
    def export_hf_state(self, out_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None):
        """Write an HF checkpoint folder (config, tokenizer files copied, safetensors) on rank 0; returns its
        path. Without `out_dir`, returns the state as a dict of CPU tensors (small models, tests)."""
        return self.weights.export(out_dir, self.version, dtype)

    @_needs("params")
    def sync_weights(self, sink, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        """Push the weights in HF naming to `sink` (rank 0 only; other ranks join the collectives) in buckets
        of about `bucket_bytes`, tagged with `version` (default: the trainer's step count)."""
        self.version = self.step_count if version is None else int(version)
        return self.weights.sync(sink, self.version, bucket_bytes, dtype)

    @_needs("params")
    def send_weights(self, spec, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        """Stream the weights to the servers through a transport whose data path starts on the ranks
        (`rollverify.app.weight_transport.TransportSpec`): each rank sends from its own `spec.open_sink(rank)`, or
        only joins the gathers; nothing crosses the driver."""
        self.version = self.step_count if version is None else int(version)
        return self.weights.send(spec, self.version, bucket_bytes, dtype)

    # ------------------------------------------------------------------------------------------ checkpoints

    @_needs("params", "optimizer")
    def save_checkpoint(self, ckpt_dir: str | os.PathLike) -> Path:
        """Model, optimizer (fp32 main params and moments) and scheduler in Megatron-Core's distributed
        checkpoint format (`megatron_bridge.checkpoint`): any parallel layout can load it."""
        return checkpoint.save(ckpt_dir, self.model, self.optimizer, self.scheduler, arch=self.arch,
                               parallel=asdict(self.pcfg), model_path=str(self.model_path), step=self.step_count,
                               version=self.version)

    @_needs("params", "optimizer")
    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> None:
        """Load a checkpoint written under any parallel layout; one of another model fails before any tensor
        is read, naming what differs."""
        self.step_count, self.version = checkpoint.load(ckpt_dir, self.model, self.optimizer, self.scheduler,
                                                        arch=self.arch)

    def close(self) -> None:
        from megatron_bridge.parallel import destroy_parallel

        destroy_parallel()
