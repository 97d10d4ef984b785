"""Per-token log-probs and entropy from vocab-parallel logits, with the engine's temperature semantics.

Project-wide decision: the engine reports `log_softmax(logits / T)` at the sampled token, so the trainer
computes the same (T = 1: plain log-probs); entropy is that of the same temperature-scaled distribution.
Under TP each rank holds a vocab slice of the logits; the max, the partition function, the target logit and
the entropy sum are reduced over the TP group with Megatron-Core's forward-all-reduce / backward-identity
op, which gives each rank the exact gradient of its slice (every rank computes the same loss).
"""

from __future__ import annotations

import torch


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
