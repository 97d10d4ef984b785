"""`MicroBatchRunner`: one rank's share of a batch, packed into micro-batches and run through Megatron-Core's
forward-backward schedule; per-micro-batch results reduced over micro-batches and ranks.

The batch is split over data-parallel ranks by tokens (`batch.split_for_data_parallel`), each share grouped into
micro-batches of at most `micro_batch_tokens` (`batch.plan_micro_batches`); every DP rank runs the same number
of micro-batches (EP collectives inside the forward must pair up), padded with one-token fillers that count no
generated token. Results come from the last pipeline stage of every DP rank and are returned on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_bridge import replay
from megatron_bridge.batch import (
    MicroBatch,
    TrainSequence,
    make_micro_batch,
    plan_micro_batches,
    split_for_data_parallel,
)
from megatron_bridge.config import TrainerConfig
from megatron_bridge.convert import Layout
from megatron_bridge.logprobs import chunked_logprob_entropy, output_weight
from megatron_bridge.model import ModelArch, packed_forward, unwrap

# loss_of_mb(micro-batch, last stage's output) -> (loss sum, normaliser count, record): Megatron's loss_func
LossOfMicroBatch = Callable[[MicroBatch, torch.Tensor], tuple]

_FILLER = TrainSequence(prompt_ids=np.zeros(1, np.int64), gen_ids=np.zeros(1, np.int64))


class MicroBatchRunner:
    """The micro-batch machinery of one trainer rank over `model` (the DDP-wrapped Megatron-Core model). `cfg`
    is read at every call, so a changed `micro_batch_tokens` or `logprob_chunk_tokens` applies to the next."""

    def __init__(self, cfg: TrainerConfig, arch: ModelArch, layout: Layout, model, device: torch.device) -> None:
        from megatron.core import parallel_state as ps

        self.cfg, self.arch, self.layout, self.model, self.device = cfg, arch, layout, model, device
        self.ps = ps
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp_rank = ps.get_context_parallel_rank()
        self.moe_layer_offset = (arch.num_layers // cfg.pp) * layout.pp_rank

    def build(self, seqs: list[TrainSequence], use_replay: bool) -> list[MicroBatch]:
        """This rank's micro-batches of `seqs` (with the engine's routes attached when `use_replay`)."""
        return [self._micro_batch(seqs, idx, use_replay) for idx in self._plan(seqs)]

    def _plan(self, seqs: list[TrainSequence]) -> list[list[int]]:
        """This DP rank's micro-batches (batch indices); every DP rank gets the same number, padded with empty
        ones."""
        lengths = getattr(seqs, "lengths", None) or [s.num_inputs for s in seqs]
        shards = split_for_data_parallel(lengths, self.dp)
        if any(seqs[i] is None for i in shards[self.dp_rank]):
            raise ValueError(f"data-parallel rank {self.dp_rank} lacks sequences of its share: the batch was cut "
                             "by another rule than split_for_data_parallel")
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

    def _micro_batch(self, seqs: list[TrainSequence], index: list[int], use_replay: bool) -> MicroBatch:
        if not index:  # empty filler: one 1-token row, no generated tokens counted
            mb = make_micro_batch([_FILLER], [0], self._pad_to, self._segment_multiple)
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

    def _forward_step(self, loss_of_mb: LossOfMicroBatch, for_backward: bool = False):
        """A Megatron forward_step_func over an iterator of MicroBatch; `for_backward`: the backward recomputes
        layers, which replay the forward's routes (`replay.replaying`)."""
        dev = self.device

        def step(data_iterator, model):
            mb: MicroBatch = next(data_iterator)
            sp_slice = None
            if self.cfg.sequence_parallel:  # each TP rank routes its own slice of the tokens
                per = mb.packed.num_tokens() // self.cfg.tp
                sp_slice = slice(self.layout.tp_rank * per, (self.layout.tp_rank + 1) * per)
            tokens = mb.packed.context_parallel_index(self.cfg.cp, self.cp_rank) if self.cfg.cp > 1 else None
            with replay.replaying(mb.routes, self.moe_layer_offset, sp_slice=sp_slice, device=dev,
                                  for_backward=for_backward):
                out = packed_forward(model, mb.packed, dev, tokens=tokens)

            def loss_func(output):
                return loss_of_mb(mb, output)

            return out, loss_func

        return step

    def token_stats(self, mb: MicroBatch, output: torch.Tensor, temperature: float):
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

    def run(self, mbs: list[MicroBatch], loss_of_mb: LossOfMicroBatch, forward_only: bool) -> list[dict]:
        """Megatron-Core's forward-backward schedule over `mbs`; the records `loss_of_mb` returned on this
        rank's last pipeline stage (empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        if self.cfg.pp > 1 and len({mb.packed.shape[0] for mb in mbs}) > 1:
            raise AssertionError("pipeline stages exchange [S, B, H]: rows per micro-batch must be equal under PP")
        seq_len = max(mb.packed.shape[1] for mb in mbs)  # the whole pack's: Megatron-Core divides by cp (and tp)
        recomputes = not forward_only and self.cfg.recompute == "full"  # selective: core attention, no router
        # a recomputing schedule leaves routes queued for its backward: `replayed` clears them however it ends
        # (a forward-only or non-recomputing one leaves nothing held, and keeps what `replay.recording` recorded)
        with replay.replayed() if recomputes else contextlib.nullcontext():
            out = fb(forward_step_func=self._forward_step(loss_of_mb, for_backward=recomputes),
                     data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs), seq_length=seq_len,
                     micro_batch_size=mbs[0].packed.shape[0], forward_only=forward_only)
        return list(out) if out else []

    def share_results(self, mine: list[dict]) -> list[dict]:
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

    def reduce_metrics(self, results: list[dict]) -> dict[str, float]:
        """Reduce per-micro-batch statistics over micro-batches and DP ranks (last PP stage): the loss is
        sum / normaliser count (what the gradient used), `*_sum` are token-weighted means, `*_max` maxima."""
        local: dict[str, float] = {}
        for r in results:
            for k, v in r.items():
                v = float(v)
                local[k] = max(local.get(k, v), v) if k.endswith("_max") else local.get(k, 0.0) + v
        total: dict[str, float] = {}
        for rec in self.share_results([local]):
            for k, v in rec.items():
                total[k] = max(total.get(k, v), v) if k.endswith("_max") else total.get(k, 0.0) + v
        n = total.pop("tokens", 0.0)
        out = {"tokens": n, "loss": total.pop("loss_total", 0.0) / max(total.pop("norm", 0.0), 1.0)}
        for k, v in total.items():
            out[k.removesuffix("_sum")] = v if k.endswith("_max") else v / max(n, 1.0)
        return out
