"""Per-token log-probs and entropy from vocab-parallel logits, with the engine's temperature semantics.

Project-wide decision: the engine reports `log_softmax(logits / T)` at the sampled token, so the trainer
computes the same (T = 1: plain log-probs); entropy is that of the same temperature-scaled distribution.
Under TP each rank holds a vocab slice of the logits; the max, the partition function, the target logit and
the entropy sum are reduced over the TP group with Megatron-Core's forward-all-reduce / backward-identity
op, which gives each rank the exact gradient of its slice (every rank computes the same loss).

The trainer never materialises the logits of a whole micro-batch: `defer_output_layer` makes the model return
its final hidden states, and `chunked_logprob_entropy` projects only the rows that predict generated tokens,
`chunk_tokens` rows at a time, each chunk under activation checkpointing, so at most one `[chunk x vocab/tp]`
float32 block (and its few temporaries) is alive in the forward and in the backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is None or torch.distributed.get_world_size(group) == 1:
        return t
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t, group=group)


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log_softmax(logits / T)[target]` and the entropy of `softmax(logits / T)`, per row, in float32.

    logits: [N, V_local] (this rank's contiguous vocab slice, rank r holds [r*V_local, (r+1)*V_local));
    targets: [N] global token ids. Differentiable w.r.t. logits; the input is not modified.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding reports T=1 log-probs), got {temperature}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    v_local = z.shape[-1]
    rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    with torch.no_grad():
        zmax = z.max(dim=-1, keepdim=True).values
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    z = z - zmax
    ez = z.exp()
    sum_ez = _reduce(ez.sum(dim=-1), tp_group)
    log_z = sum_ez.log()
    local = targets.long() - rank * v_local
    inside = (local >= 0) & (local < v_local)
    picked = z.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * inside
    target_z = _reduce(picked, tp_group)
    logprob = target_z - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v z_v   (z already shifted; the shift cancels)
        pz = _reduce((ez * z).sum(dim=-1), tp_group) / sum_ez
        entropy = log_z - pz
    return logprob, entropy


def chunked_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    chunk_tokens: int = 1024,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_parallel_logprob_entropy(hidden @ weight.T, targets)` computed `chunk_tokens` rows at a time.

    hidden: [N, H] final hidden states of the predicting positions (already TP-replicated, see
    `DeferredOutputLayer`); weight: [V_local, H] this rank's output-layer slice. Logits are computed in the
    weight's dtype (as Megatron's output layer does) and reduced in float32. With autograd on, each chunk is
    recomputed in the backward instead of keeping its logits.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = hidden.shape[0]
    if n == 0:
        z = hidden.new_zeros(0, dtype=torch.float32) + hidden.sum() * 0  # keeps the graph for empty fillers
        return z, (z.clone() if with_entropy else None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lps, ents = [], []
    for a in range(0, n, chunk_tokens):
        args = (hidden[a:a + chunk_tokens], weight, targets[a:a + chunk_tokens], temperature, tp_group,
                with_entropy)
        lp, ent = checkpoint(_project_chunk, *args, use_reentrant=False) if grad and n > chunk_tokens \
            else _project_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _project_chunk(h, w, t, temperature, tp_group, with_entropy):
    logits = h.to(w.dtype) @ w.t()
    return vocab_parallel_logprob_entropy(logits, t, temperature=temperature, tp_group=tp_group,
                                          with_entropy=with_entropy)


class DeferredOutputLayer(torch.nn.Module):
    """Stands in for GPTModel's `output_layer`: the model returns its final hidden states, TP-replicated.

    Holds the same `weight` parameter (same state-dict key, same optimizer and DDP treatment). Its forward does
    the input half of a `ColumnParallelLinear`: the sequence-parallel all-gather (reduce-scatter in the
    backward) or, without SP, the identity whose backward all-reduces over TP, so a later local projection by
    this rank's vocab slice gets the exact gradient.
    """

    def __init__(self, layer: torch.nn.Module, tp_group) -> None:
        super().__init__()
        self.weight = layer.weight  # None when tied to the embedding on the same stage
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
        self.tp_group = tp_group

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, True, group=self.tp_group)
        elif self.tp_group is not None and self.tp_group.size() > 1:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group)
        return hidden_states, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """As `ColumnParallelLinear`'s: the weight is split along the vocabulary (dim 0) over TP."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def defer_output_layer(model) -> None:
    """Make a GPTModel (last pipeline stage) return hidden states instead of logits (see module docstring)."""
    from megatron.core import parallel_state

    if getattr(model, "post_process", False) and not isinstance(model.output_layer, DeferredOutputLayer):
        model.output_layer = DeferredOutputLayer(model.output_layer,
                                                 parallel_state.get_tensor_model_parallel_group())


def output_weight(model) -> torch.Tensor:
    """The [V_local, H] weight the model's logits are computed with (the embedding's when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
