"""`MegatronTrainer`: the Megatron-Core side of the loop (log-probs, GRPO step, export, checkpoints).

SPMD: every rank constructs the trainer and calls each method with the same arguments (the full batch); the
trainer takes its data-parallel share itself and returns the full result on every rank. World size 1 runs in
the caller's process; `SpawnedTrainer` runs N ranks as child processes behind the same methods, so the loop's
driver stays a plain sequence of calls.

Micro-batches go through Megatron-Core's forward-backward schedule (pipeline parallelism for free) with
`calculate_per_token_loss`: each micro-batch returns its summed token loss and token count, and Megatron divides
the gradients by the token count of the whole mini-batch over micro-batches and data-parallel ranks, which is
the design's token-mean (never the sum of TIS weights).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_bridge import checkpoint, convert, policy_loss, replay
from megatron_bridge.batch import (
    MicroBatch,
    TrainSequence,
    make_micro_batch,
    plan_micro_batches,
    split_for_data_parallel,
)
from megatron_bridge.logprobs import chunked_logprob_entropy, defer_output_layer, output_weight
from megatron_bridge.model import (
    UnsupportedCheckpoint,
    build_model,
    check_layout,
    packed_forward,
    recompute_options,
    transformer_config,
    unwrap,
)
from megatron_bridge.parallel import ParallelConfig, init_parallel, use_cpu
from rollverify.config import TrainerConfig


def resolve_device(device: str) -> str:
    """`TrainerConfig.device` on this machine: auto is cuda where a GPU is visible, else cpu."""
    if device == "auto":
        return "cpu" if use_cpu() else "cuda"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`ModelConfig.dtype` for the trainer on `device`: auto is float32 on CPU and bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _sequences(batch: Sequence[TrainSequence]) -> list[TrainSequence]:
    seqs = list(batch)
    for i, s in enumerate(seqs):
        if not isinstance(s, TrainSequence):
            raise TypeError(f"sequence {i} is a {type(s).__name__}, not a TrainSequence "
                            "(megatron_bridge.loop_adapter.train_sequence converts a rollverify Response)")
    return seqs


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
        if cfg.sequence_parallel and cfg.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it splits the sequence over the TP group)")
        if self.arch.moe and cfg.tp > 1 and (not cfg.sequence_parallel or cfg.ep * cfg.etp == 1):
            # Megatron-Core trains MoE under TP only with sequence parallelism. With ep == etp == 1 the whole
            # experts would be copies on every TP rank, each seeing its own tokens, and Megatron-Core reduces
            # expert gradients over TP only for expert-parallel or expert-tensor-parallel weights
            raise UnsupportedCheckpoint(f"MoE with tp={cfg.tp} > 1 needs sequence_parallel=True and ep > 1 or "
                                        f"etp > 1 (got sequence_parallel={cfg.sequence_parallel}, ep={cfg.ep}, "
                                        f"etp={cfg.etp})")
        if cfg.optimizer != "adam" and cfg.use_distributed_optimizer:
            raise ValueError("Megatron-Core's distributed optimizer supports Adam only: set "
                             "use_distributed_optimizer=False for optimizer='sgd'")
        check_layout(self.arch, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp, etp=cfg.etp)
        if cfg.max_seq_len < 0 or cfg.logprob_chunk_tokens < 1:
            raise ValueError(f"max_seq_len must be >= 0 (0: the model's context) and logprob_chunk_tokens >= 1; "
                             f"got {cfg.max_seq_len} and {cfg.logprob_chunk_tokens}")
        if cfg.recompute != "none" and self.arch.moe and cfg.replay_train:
            raise ValueError(f"recompute={cfg.recompute!r} with MoE routing replay is not supported: the recomputed "
                             f"forward would route freely; set recompute='none' or replay_train=False")
        recompute_options(cfg.recompute, self.arch.moe)  # a bad value fails here, before any process group
        self.pcfg = ParallelConfig(tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp, etp=cfg.etp)
        init_parallel(self.pcfg, device=self.device.type, seed=seed, timeout_s=cfg.dist_timeout_s)
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.layout = convert.Layout.current()
        self.cp_rank = ps.get_context_parallel_rank()
        self.tconfig = transformer_config(self.arch, tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp, etp=cfg.etp,
                                          dtype=self.dtype,
                                          recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel)
        self.tconfig.calculate_per_token_loss = True
        model = build_model(self.arch, self.tconfig)
        if self.device.type == "cuda":
            model.cuda(torch.cuda.current_device())
        convert.load_hf_checkpoint(model, self.model_path, self.arch, self.layout)
        defer_output_layer(model)
        self.model = self._wrap(model)
        self.optimizer, self.scheduler = self._make_optimizer()
        self.step_count = 0
        self.version = 0
        self._moe_layer_offset = (self.arch.num_layers // cfg.pp) * self.layout.pp_rank

    # ------------------------------------------------------------------------------------------ setup

    def _wrap(self, model):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.tconfig, model)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer,
        )
        ddp = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_cfg, module=model)
        self.tconfig.no_sync_func = ddp.no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        return ddp

    def _make_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        c = self.cfg
        ocfg = OptimizerConfig(
            optimizer=c.optimizer, lr=c.lr, min_lr=c.min_lr, weight_decay=c.weight_decay,
            adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.grad_clip,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=c.use_distributed_optimizer,
        )
        opt = get_megatron_optimizer(ocfg, [self.model])
        sched = OptimizerParamScheduler(
            opt, init_lr=0.0 if c.lr_warmup_steps else c.lr, max_lr=c.lr, min_lr=c.min_lr,
            lr_warmup_steps=c.lr_warmup_steps, lr_decay_steps=max(c.steps, c.lr_warmup_steps + 1),
            lr_decay_style=c.lr_decay_style, start_wd=c.weight_decay, end_wd=c.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        return opt, sched

    # ------------------------------------------------------------------------------------------ batches

    def _plan(self, seqs: list[TrainSequence]) -> list[list[int]]:
        """This DP rank's micro-batches (batch indices); every DP rank gets the same number (EP collectives
        inside the forward must pair up), padded with empty micro-batches."""
        lengths = [s.num_inputs for s in seqs]
        shards = split_for_data_parallel(lengths, self.dp)
        plans = [[[shard[i] for i in g] for g in plan_micro_batches([lengths[i] for i in shard],
                                                                     self.cfg.micro_batch_tokens)]
                 for shard in shards]
        n = max(1, max(len(p) for p in plans))
        mine = plans[self.dp_rank]
        return mine + [[] for _ in range(n - len(mine))]

    @property
    def _pad_to(self) -> int:
        """Packs are padded to a multiple of this (sequence parallelism splits each CP rank's tokens evenly
        over TP)."""
        return (self.cfg.tp if self.cfg.sequence_parallel else 1) * self._segment_multiple

    @property
    def _segment_multiple(self) -> int:
        """Every packed sequence is padded to a multiple of this (context parallelism: 2 * cp equal chunks)."""
        return 2 * self.cfg.cp if self.cfg.cp > 1 else 1

    _DUMMY = TrainSequence(prompt_ids=np.zeros(1, np.int64), gen_ids=np.zeros(1, np.int64))

    def _micro_batch(self, seqs: list[TrainSequence], index: list[int], use_replay: bool) -> MicroBatch:
        if not index:  # empty filler: one 1-token row, no generated tokens counted
            mb = make_micro_batch([self._DUMMY], [0], self._pad_to, self._segment_multiple)
            mb.seq_index, mb.gen_counts = [], []
            mb.gen_rows, mb.gen_targets = mb.gen_rows[:0], mb.gen_targets[:0]
            if use_replay:
                mb.routes = [torch.arange(self.arch.top_k).view(1, -1).repeat(mb.packed.num_tokens(), 1)
                             for _ in range(self.arch.num_layers)]
            return mb
        mb = make_micro_batch(seqs, index, self._pad_to, self._segment_multiple)
        if use_replay:
            replay.attach_routes(mb, seqs, self.arch.num_layers, self.arch.top_k, self.arch.num_experts)
        return mb

    def _forward_step(self, loss_of_mb: Callable[[MicroBatch, torch.Tensor], tuple]):
        """A Megatron forward_step_func over an iterator of MicroBatch."""
        dev = self.device

        def step(data_iterator, model):
            mb: MicroBatch = next(data_iterator)
            sp_slice = None
            if self.cfg.sequence_parallel:  # each TP rank routes its own slice of the tokens
                per = mb.packed.num_tokens() // self.cfg.tp
                sp_slice = slice(self.layout.tp_rank * per, (self.layout.tp_rank + 1) * per)
            tokens = mb.packed.context_parallel_index(self.cfg.cp, self.cp_rank) if self.cfg.cp > 1 else None
            with replay.replaying(mb.routes, self._moe_layer_offset, sp_slice=sp_slice, device=dev):
                out = packed_forward(model, mb.packed, dev, tokens=tokens)

            def loss_func(output):
                return loss_of_mb(mb, output)

            return out, loss_func

        return step

    def _token_stats(self, mb: MicroBatch, output: torch.Tensor, temperature: float):
        """Log-probs and entropies of the generated tokens from the last stage's hidden states [1, T, H].

        Under context parallelism the hidden states of every CP rank are gathered first, so each rank computes
        the whole micro-batch's loss: the gather's backward sums the CP ranks' (equal) gradients into each
        rank's tokens, and Megatron-Core divides by the token count summed over DP x CP, so the gradient is
        the loss's own."""
        hidden = output.reshape(-1, output.shape[-1])
        rows = mb.gen_rows
        if self.cfg.cp > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, True, group=self.ps.get_context_parallel_group())
            order = torch.cat([mb.packed.context_parallel_index(self.cfg.cp, r) for r in range(self.cfg.cp)])
            where = torch.empty_like(order)
            where[order] = torch.arange(order.numel())  # gathered row of each pack position
            rows = where[rows]
        hidden = hidden.index_select(0, rows.to(output.device))  # [N, H]
        tp_group = self.ps.get_tensor_model_parallel_group() if self.cfg.tp > 1 else None
        return chunked_logprob_entropy(hidden, output_weight(unwrap(self.model)), mb.gen_targets.to(output.device),
                                       temperature=temperature, tp_group=tp_group,
                                       chunk_tokens=self.cfg.logprob_chunk_tokens)

    def _run(self, mbs: list[MicroBatch], loss_of_mb, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        if self.cfg.pp > 1 and len({mb.packed.shape[0] for mb in mbs}) > 1:
            raise AssertionError("pipeline stages exchange [S, B, H]: rows per micro-batch must be equal under PP")
        seq_len = max(mb.packed.shape[1] for mb in mbs)  # the whole pack's: Megatron-Core divides by cp (and tp)
        out = fb(forward_step_func=self._forward_step(loss_of_mb), data_iterator=iter(mbs), model=[self.model],
                 num_microbatches=len(mbs), seq_length=seq_len, micro_batch_size=mbs[0].packed.shape[0],
                 forward_only=forward_only)
        return list(out) if out else []

    def _share_results(self, mine: list[dict]) -> list[dict]:
        """Per-micro-batch results from the last PP stage of every DP rank, on every rank."""
        ps = self.ps
        if self.cfg.pp > 1:
            obj = [mine if ps.is_pipeline_last_stage() else None]
            dist.broadcast_object_list(obj, src=dist.get_global_rank(ps.get_pipeline_model_parallel_group(),
                                                                      self.cfg.pp - 1),
                                       group=ps.get_pipeline_model_parallel_group())
            mine = obj[0]
        if self.dp == 1:
            return mine
        gathered: list[Any] = [None] * self.dp
        dist.all_gather_object(gathered, mine, group=ps.get_data_parallel_group())
        return [r for part in gathered for r in part]

    # ------------------------------------------------------------------------------------------ log-probs

    def _logprobs(self, seqs: list[TrainSequence], use_replay: bool, temperature: float) -> tuple[list, list]:
        use_replay = use_replay and self.arch.moe
        self._check_batch(seqs)
        if use_replay:
            self._check_all_routes(seqs)
        plan = self._plan(seqs)
        mbs = [self._micro_batch(seqs, idx, use_replay) for idx in plan]

        def loss_of_mb(mb, output):
            lp, ent = self._token_stats(mb, output, temperature)
            rec = {"seq_index": mb.seq_index, "counts": mb.gen_counts,
                   "lp": lp.detach().float().cpu(), "ent": ent.detach().float().cpu()}
            return torch.zeros((), device=output.device), torch.tensor(0, dtype=torch.int), rec

        self.model.eval()
        with torch.no_grad():
            results = self._share_results(self._run(mbs, loss_of_mb, forward_only=True))
        lps: list[Any] = [None] * len(seqs)
        ents: list[Any] = [None] * len(seqs)
        for rec in results:
            for i, a, b in zip(rec["seq_index"], rec["lp"].split(rec["counts"]), rec["ent"].split(rec["counts"]),
                               strict=True):
                lps[i], ents[i] = a.numpy(), b.numpy()
        return lps, ents

    def compute_logprobs(self, batch: Sequence[TrainSequence], *, replay: bool | None = None,
                         temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Log-probs (temperature-scaled, as the engine reports them) and entropies of every generated token,
        flat float32 in batch order. `replay` defaults to `replay_verify` (this is the verification forward)."""
        seqs = _sequences(batch)
        if not seqs:
            return np.zeros(0, np.float32), np.zeros(0, np.float32)
        use_replay = self.cfg.replay_verify if replay is None else replay
        lps, ents = self._logprobs(seqs, use_replay, temperature)
        return np.concatenate(lps).astype(np.float32), np.concatenate(ents).astype(np.float32)

    # ------------------------------------------------------------------------------------------ train

    def train_step(self, batch: Sequence[TrainSequence], *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step of the GRPO loss on `batch` (sequences with advantages and rollout log-probs).

        The old log-probs of the ratio are recomputed here, before the step, with the same routing as the
        training forward, and feed TIS: `w = min(exp(lp_old_train - lp_rollout), C)` (detached).
        """
        t0 = time.perf_counter()
        seqs = _sequences(batch)
        if not seqs:
            raise ValueError("train_step needs at least one sequence")
        for i, s in enumerate(seqs):
            if s.advantage is None:
                raise ValueError(f"sequence {i} has no advantage")
            if self.cfg.use_tis and s.rollout_logprobs is None:
                raise ValueError(f"sequence {i} has no rollout log-probs (needed for TIS; set use_tis=False)")
        use_replay = self.cfg.replay_train and self.arch.moe
        old, _ = self._logprobs(seqs, use_replay, temperature)
        t_old = time.perf_counter() - t0

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = self._loss_pass(seqs, old, use_replay, temperature, forward_only=False)
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.step_count += 1
        metrics.update(self._mismatch(seqs, old))
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            update_ok=float(bool(ok)),
            lr=lr,
            step=float(self.step_count),
            time_old_logprob_s=t_old,
            time_step_s=time.perf_counter() - t0,
        )
        return metrics

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (model inputs: prompt + generated - 1) the trainer accepts."""
        return self.cfg.max_seq_len or self.arch.context_length

    def _check_batch(self, seqs: list[TrainSequence]) -> None:
        """Every rank checks the whole batch before any forward: too long a sequence, or a token outside the
        vocabulary, fails here with its numbers instead of inside a collective."""
        limit = self.max_seq_len
        for i, s in enumerate(seqs):
            if s.num_inputs > limit:
                raise ValueError(
                    f"sequence {i} has {s.prompt_ids.size} prompt + {s.gen_ids.size} generated tokens = "
                    f"{s.num_inputs} model inputs, more than the trainer's context of {limit} (trainer "
                    f"max_seq_len={self.cfg.max_seq_len}, model context {self.arch.context_length}): shorten "
                    f"the response or raise max_seq_len")
            lo = min(int(s.prompt_ids.min()), int(s.gen_ids.min()))
            hi = max(int(s.prompt_ids.max()), int(s.gen_ids.max()))
            if lo < 0 or hi >= self.arch.vocab_size:
                raise ValueError(f"sequence {i} has token ids in [{lo}, {hi}], outside the model's vocabulary "
                                 f"[0, {self.arch.vocab_size})")

    def _check_all_routes(self, seqs: list[TrainSequence]) -> None:
        """Every rank checks the whole batch, so a bad array fails all ranks before any collective."""
        for i, s in enumerate(seqs):
            replay.check_routes(s, self.arch.num_layers, self.arch.top_k, self.arch.num_experts, where=str(i))

    def _loss_pass(self, seqs: list[TrainSequence], old: list, use_replay: bool, temperature: float,
                   forward_only: bool) -> dict[str, float]:
        plan = self._plan(seqs)
        mbs = [self._micro_batch(seqs, idx, use_replay) for idx in plan]
        for mb in mbs:
            mb.extras = self._loss_inputs(seqs, mb, old)

        def loss_of_mb(mb, output):
            lp, ent = self._token_stats(mb, output, temperature)
            x = mb.extras
            dev = lp.device
            rollout = x["rollout"].to(dev) if x["rollout"] is not None else None
            terms = policy_loss.terms(lp, x["old"].to(dev), rollout, x["adv"].to(dev), x["mask"].to(dev),
                                      mb.gen_counts, self.cfg)
            stats = {k: v.detach().float().cpu() for k, v in terms.stats.items()}
            stats["entropy_sum"] = (ent.detach().float().cpu() * x["mask"]).sum()
            stats["loss_total"] = terms.loss_sum.detach().float().cpu()
            stats["tokens"] = x["mask"].sum().float()
            stats["norm"] = terms.count.float().cpu()
            return terms.loss_sum, terms.count.to(dev), stats

        if forward_only:
            with torch.no_grad():
                return self._reduce_metrics(self._run(mbs, loss_of_mb, forward_only=True))
        return self._reduce_metrics(self._run(mbs, loss_of_mb, forward_only=False))

    def loss_on(self, batch: Sequence[TrainSequence], old_logprobs: np.ndarray, *,
                temperature: float = 1.0) -> dict[str, float]:
        """The train-step loss and its statistics on `batch` at the current weights, without a step; the
        ratio's denominator is `old_logprobs` (flat, as `compute_logprobs` returns them)."""
        seqs = _sequences(batch)
        self._check_batch(seqs)
        counts = [s.gen_ids.size for s in seqs]
        old = np.split(np.asarray(old_logprobs, np.float32), np.cumsum(counts)[:-1])
        self.model.eval()
        return self._loss_pass(seqs, old, self.cfg.replay_train and self.arch.moe, temperature, forward_only=True)

    def _loss_inputs(self, seqs: list[TrainSequence], mb: MicroBatch, old: list) -> dict:
        adv, mask, rollout, o = [], [], [], []
        for i in mb.seq_index:
            s = seqs[i]
            g = s.gen_ids.size
            a = np.asarray(s.advantage, dtype=np.float32)
            adv.append(np.broadcast_to(a, (g,)) if a.ndim == 0 else a.reshape(g))
            mask.append(np.ones(g, np.float32) if s.loss_mask is None else np.asarray(s.loss_mask, np.float32))
            rollout.append(np.asarray(s.rollout_logprobs, np.float32) if s.rollout_logprobs is not None
                           else np.zeros(g, np.float32))
            o.append(old[i])
        cat = (lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.float32))) if mb.seq_index else \
            (lambda xs: torch.zeros(0))
        return {"adv": cat(adv), "mask": cat(mask), "old": cat(o),
                "rollout": cat(rollout) if self.cfg.use_tis else None}

    def _reduce_metrics(self, results: list[dict]) -> dict[str, float]:
        """Reduce per-micro-batch statistics over micro-batches and DP ranks (last PP stage): the loss is
        sum / normaliser count (what the gradient used), `*_sum` are token-weighted means, `*_max` maxima."""
        local: dict[str, float] = {}
        for r in results:
            for k, v in r.items():
                v = float(v)
                local[k] = max(local.get(k, v), v) if k.endswith("_max") else local.get(k, 0.0) + v
        total: dict[str, float] = {}
        for rec in self._share_results([local]):
            for k, v in rec.items():
                total[k] = max(total.get(k, v), v) if k.endswith("_max") else total.get(k, 0.0) + v
        n = total.pop("tokens", 0.0)
        out = {"tokens": n, "loss": total.pop("loss_total", 0.0) / max(total.pop("norm", 0.0), 1.0)}
        for k, v in total.items():
            out[k.removesuffix("_sum")] = v if k.endswith("_max") else v / max(n, 1.0)
        return out

    def _mismatch(self, seqs: list[TrainSequence], old: list) -> dict[str, float]:
        """Trainer/engine log-prob mismatch on the recomputed old log-probs (same weights as the engine had)."""
        diffs = [old[i] - np.asarray(s.rollout_logprobs, np.float32) for i, s in enumerate(seqs)
                 if s.rollout_logprobs is not None]
        if not diffs:
            return {}
        d = np.concatenate(diffs).astype(np.float64)
        return {"mismatch_abs_mean": float(np.abs(d).mean()), "mismatch_abs_max": float(np.abs(d).max()),
                "mismatch_ops_mean": float(np.abs(np.expm1(d)).mean())}

    # ------------------------------------------------------------------------------------------ export / sync

    def iter_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time, on every rank (collective: all ranks iterate together)."""
        return convert.iter_hf_tensors(self.model, self.arch, self.layout, dtype=dtype)

    def export_hf_state(self, out_dir: str | os.PathLike | None = None, dtype: torch.dtype | None = None):
        """Write an HF checkpoint folder (config, tokenizer files copied, safetensors) on rank 0; returns its
        path. Without `out_dir`, returns the state as a dict of CPU tensors (small models, tests)."""
        if out_dir is None:
            return {k: v.detach().cpu().clone() for k, v in self.iter_hf_tensors(dtype)}
        from megatron_bridge.weight_sync import DiskSink, sync

        sink = DiskSink(out_dir, self.model_path) if self.is_driver else None
        sync(self.iter_hf_tensors(dtype), sink, self.version, is_driver=self.is_driver)
        return Path(out_dir)

    @property
    def is_driver(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def sync_weights(self, sink, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        """Push the weights in HF naming to `sink` (rank 0 only; other ranks join the collectives) in buckets
        of about `bucket_bytes`, tagged with `version` (default: the trainer's step count)."""
        from megatron_bridge.weight_sync import sync

        self.version = self.step_count if version is None else int(version)
        return sync(self.iter_hf_tensors(dtype), sink if self.is_driver else None, self.version,
                    bucket_bytes=bucket_bytes, is_driver=self.is_driver)

    def send_weights(self, spec, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        """Stream the weights to the servers through a transport whose data path starts on the ranks
        (`sglang_ext.weight_transport.TransportSpec`): each rank sends from its own `spec.open_sink(rank)`, or
        only joins the gathers; nothing crosses the driver."""
        from megatron_bridge.weight_sync import sync

        rank = dist.get_rank() if dist.is_initialized() else 0
        sink = spec.open_sink(rank)
        self.version = self.step_count if version is None else int(version)
        return sync(self.iter_hf_tensors(dtype), sink, self.version, bucket_bytes=bucket_bytes,
                    is_driver=sink is not None)

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, ckpt_dir: str | os.PathLike) -> Path:
        """Model, optimizer (fp32 main params and moments) and scheduler in Megatron-Core's distributed
        checkpoint format (`megatron_bridge.checkpoint`): any parallel layout can load it."""
        return checkpoint.save(ckpt_dir, self.model, self.optimizer, self.scheduler, arch=self.arch,
                               parallel=asdict(self.pcfg), model_path=str(self.model_path), step=self.step_count,
                               version=self.version)

    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> None:
        """Load a checkpoint written under any parallel layout; one of another model fails before any tensor
        is read, naming what differs."""
        self.step_count, self.version = checkpoint.load(ckpt_dir, self.model, self.optimizer, self.scheduler,
                                                        arch=self.arch)

    def close(self) -> None:
        from megatron_bridge.parallel import destroy_parallel

        destroy_parallel()

