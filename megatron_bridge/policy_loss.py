"""The algorithm core's policy losses (`rollverify.losses`) applied to one micro-batch of the trainer.

Megatron-Core runs with `calculate_per_token_loss`: each micro-batch returns an unnormalised loss and its
normaliser count, and Megatron divides the gradients by the count summed over micro-batches and data-parallel
ranks. So the losses are called with a normaliser of 1 (a sum) and the count of the aggregation mode is
returned beside them (`rollverify.losses.aggregate`):

* token-mean: sum over valid tokens, count = valid tokens (the design's token-mean over the mini-batch);
* seq-mean-token-mean / seq-mean-token-sum: sum over sequences of their token-means / token-sums,
  count = sequences.

A sequence never spans two micro-batches, so the per-sequence terms are whole. Statistics come back as sums
weighted by the micro-batch's valid tokens (`*_sum`) or as maxima (`*_max`), so the trainer can reduce them
over micro-batches and ranks exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_bridge.batch import MicroBatch, TrainSequence
from megatron_bridge.config import TrainerConfig
from rollverify import losses

KINDS = ("ppo", "gspo", "sapo", "vespo")


@dataclass
class LossTerms:
    loss_sum: torch.Tensor  # differentiable, unnormalised
    count: torch.Tensor  # int: what Megatron divides by (summed over micro-batches and DP ranks)
    stats: dict[str, torch.Tensor]  # "<name>_sum" (token-weighted) or "<name>_max"


def _padded(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    rows = torch.zeros(len(counts), max(counts), dtype=x.dtype, device=x.device)
    for i, part in enumerate(x.split(counts)):
        rows[i, :part.numel()] = part
    return rows


def agg_mode(cfg: TrainerConfig) -> str:
    """The aggregation of `cfg`'s loss: `loss_agg_mode`, else the loss's default."""
    if cfg.loss_kind not in KINDS:
        raise ValueError(f"unknown loss {cfg.loss!r}: one of grpo, {', '.join(KINDS)}")
    mode = cfg.loss_agg_mode or losses.DEFAULT_AGG[cfg.loss_kind]
    if mode not in losses.AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {losses.AGG_MODES} (or None: the loss's own), got {mode!r}")
    return mode


def terms(lp: torch.Tensor, old_lp: torch.Tensor, rollout_lp: torch.Tensor | None, adv: torch.Tensor,
          mask: torch.Tensor, counts: list[int], cfg: TrainerConfig) -> LossTerms:
    """lp, old_lp, rollout_lp, adv, mask: flat [N] over the micro-batch's generated tokens, `counts` per
    sequence. An empty micro-batch (a filler that keeps ranks in step) gives a zero loss that still touches
    `lp`, so the backward reaches every parameter."""
    mode, kind = agg_mode(cfg), cfg.loss_kind
    n_tok = mask.sum()
    if not counts or n_tok == 0:
        return LossTerms(lp.sum() * 0.0, torch.zeros((), dtype=torch.int), {})
    corr = cfg.correction  # slime's mask of older tokens is in `mask` already (`loss_inputs`)
    weighting = corr.weighting
    rollout = rollout_lp if weighting is not None else None
    corrected = weighting not in (None, "tis")  # tis: each loss's own TIS weight, capped at corr.tis_cap
    if kind in ("gspo", "vespo") or mode != "token-mean" or (
            corrected and weighting in losses.SEQUENCE_CORRECTIONS):  # padded [sequences, tokens]
        lp, old_lp, adv, mask = (_padded(x, counts) for x in (lp, old_lp, adv, mask))
        rollout = _padded(rollout, counts) if rollout is not None else None
    common = dict(rollout_logprobs=rollout, tis_cap=corr.tis_cap, agg_mode=mode, global_count=1)
    corr_stats: dict[str, torch.Tensor] = {}
    if corrected:  # the correction's weight replaces TIS; its loss mask shrinks the normaliser
        weight, keep, corr_stats = losses.behaviour_correction(corr, old_lp, rollout, mask)
        mask = mask.bool() & keep
        common["behaviour_weight"] = weight
    if kind == "ppo":
        total, m = losses.ppo_tis_loss(lp, old_lp, advantages=adv, mask=mask, eps_low=cfg.eps_low,
                                       eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c, **common)
    elif kind == "sapo":
        total, m = losses.sapo_loss(lp, old_lp, adv, mask, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg,
                                    **common)
    elif kind == "gspo":
        total, m = losses.gspo_loss(lp, old_lp, adv, mask, eps_low=cfg.gspo_eps_low, eps_high=cfg.gspo_eps_high,
                                    **common)
    else:
        total, m = losses.vespo_loss(lp, old_lp, adv, mask, c1_pos=cfg.vespo_c1_pos, c2_pos=cfg.vespo_c2_pos,
                                     c1_neg=cfg.vespo_c1_neg, c2_neg=cfg.vespo_c2_neg, **common)
    count = mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()
    stats = {}
    for k, v in (m | corr_stats).items():
        if k == "pg_loss":
            continue
        if k.endswith("_max"):
            stats[k] = v.detach().float()
        else:
            stats[f"{k}_sum"] = v.detach().float() * n_tok.float()
    return LossTerms(total, count.to(torch.int), stats)


def loss_inputs(seqs: list[TrainSequence], mb: MicroBatch, old: list[np.ndarray], rollout_logprobs: bool,
                mask_older_than: int | None = None) -> dict:
    """The per-token inputs of `mb`'s loss, flat over its generated tokens: advantages (a scalar broadcast
    over its sequence), loss mask, old log-probs (`old[i]` of batch sequence i) and, with `rollout_logprobs`
    (the correction reads them), the engine's log-probs. `mask_older_than` (slime's
    --mask-offpolicy-in-partial-rollout, `offpolicy_mask`): tokens sampled by an older policy version than this
    one leave the loss mask."""
    adv, mask, rollout, o = [], [], [], []
    for i in mb.seq_index:
        s = seqs[i]
        g = s.gen_ids.size
        a = np.asarray(s.advantage, dtype=np.float32)
        adv.append(np.broadcast_to(a, (g,)) if a.ndim == 0 else a.reshape(g))
        m = np.ones(g, np.float32) if s.loss_mask is None else np.asarray(s.loss_mask, np.float32)
        mask.append(m if mask_older_than is None else m * offpolicy_mask(s, mask_older_than))
        rollout.append(np.asarray(s.rollout_logprobs, np.float32) if s.rollout_logprobs is not None
                       else np.zeros(g, np.float32))
        o.append(old[i])
    cat = (lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.float32))) if mb.seq_index else \
        (lambda xs: torch.zeros(0))
    return {"adv": cat(adv), "mask": cat(mask), "old": cat(o), "rollout": cat(rollout) if rollout_logprobs else None}


def check_rollout_logprobs(seqs: Sequence[TrainSequence | None], weighting: str | None) -> None:
    """Every sequence carries the engine's log-probs where the correction's `weighting`
    (`CorrectionConfig.weighting`) reads them; other ranks' sequences are None."""
    if weighting is None:
        return
    for i, s in enumerate(seqs):
        if s is not None and s.rollout_logprobs is None:
            raise ValueError(f"sequence {i} has no rollout log-probs, which trainer.correction {weighting} weighs "
                             "by; set trainer.correction.method=none")


def offpolicy_mask(seq: TrainSequence, policy_version: int) -> np.ndarray:
    """slime's masking of carried-over tokens (`slime/rollout/sglang_rollout.py`, ``generate_and_rm``: with
    --partial-rollout and --mask-offpolicy-in-partial-rollout a resumed sample's earlier response tokens get
    loss mask 0): 1 on tokens sampled by `policy_version`, the weights the trainer holds, 0 on older ones. A
    sequence without `rollout_versions` counts as the trainer's own."""
    g = seq.gen_ids.size
    if seq.rollout_versions is None:
        return np.ones(g, np.float32)
    return (np.asarray(seq.rollout_versions).reshape(g) >= policy_version).astype(np.float32)


def micro_batch_loss(lp: torch.Tensor, ent: torch.Tensor, x: dict, counts: list[int],
                     cfg: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss_func result for one micro-batch: (loss sum, normaliser count, CPU statistics), from
    its log-probs `lp`, entropies `ent` and `loss_inputs` `x`."""
    dev = lp.device
    rollout = x["rollout"].to(dev) if x["rollout"] is not None else None
    t = terms(lp, x["old"].to(dev), rollout, x["adv"].to(dev), x["mask"].to(dev), counts, cfg)
    stats = {k: v.detach().float().cpu() for k, v in t.stats.items()}
    stats["entropy_sum"] = (ent.detach().float().cpu() * x["mask"]).sum()
    stats["loss_total"] = t.loss_sum.detach().float().cpu()
    stats["tokens"] = x["mask"].sum().float()
    stats["norm"] = t.count.float().cpu()
    return t.loss_sum, t.count.to(dev), stats


def mismatch(seqs: list[TrainSequence | None], old: list[np.ndarray], policy_version: int | None,
             gather: Callable[[list], list] | None = None) -> dict[str, float]:
    """The recomputed old log-probs against the engine's, split by who sampled the token. `mismatch_*`: tokens
    sampled by the weights the trainer holds (`policy_version`), where the two should agree to the kernels'
    floor; `drift_*`: tokens of older versions (carried over), where the difference is the policy's drift
    since they were sampled (their OPS under this step's policy). Without `policy_version` or a sequence's
    `rollout_versions`, its tokens count as the trainer's own. Tokens outside the loss mask (environment tokens:
    no engine log-prob) count in neither. Sequences this rank lacks are None; `gather` (each data-parallel rank's
    list, on every rank) then joins the ranks' differences."""
    same, older = [], []
    for i, s in enumerate(seqs):
        if s is None or s.rollout_logprobs is None:
            continue
        d = (old[i] - np.asarray(s.rollout_logprobs, np.float32)).astype(np.float64)
        sampled = np.ones(d.shape, bool) if s.loss_mask is None else np.asarray(s.loss_mask).astype(bool)
        if policy_version is None or s.rollout_versions is None:
            same.append(d[sampled])
            continue
        own = np.asarray(s.rollout_versions) == policy_version
        same.append(d[own & sampled])
        older.append(d[~own & sampled])
    if gather is not None:
        parts = gather([(same, older)])
        same, older = [d for s, _ in parts for d in s], [d for _, o in parts for d in o]
    return {**_diff_stats("mismatch", same), **_diff_stats("drift", older)}


def _diff_stats(prefix: str, parts: list[np.ndarray]) -> dict[str, float]:
    """`{prefix}_tokens`, and the mean and max |difference| and mean |expm1| (OPS) over them: every key always,
    the statistics NaN over no token (rollverify.metrics: a figure with nothing to measure is null)."""
    d = np.concatenate(parts) if parts else np.zeros(0)
    if not d.size:
        nan = float("nan")
        return {f"{prefix}_tokens": 0.0, f"{prefix}_abs_mean": nan, f"{prefix}_abs_max": nan, f"{prefix}_ops_mean": nan}
    return {f"{prefix}_tokens": float(d.size), f"{prefix}_abs_mean": float(np.abs(d).mean()),
            f"{prefix}_abs_max": float(np.abs(d).max()), f"{prefix}_ops_mean": float(np.abs(np.expm1(d)).mean())}
