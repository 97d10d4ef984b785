"""The GRPO token loss as the trainer applies it to one micro-batch (sums; Megatron divides by tokens).

Design definitions: ratio r = exp(lp - lp_old) with lp_old recomputed by the trainer before the step;
decoupled clip: pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); dual clip for A < 0:
pg = min(pg, -A c); TIS weight w = min(exp(lp_old - lp_rollout), C), detached, multiplies each token's
clipped loss. Returned as sums over valid tokens: the token-mean over the whole mini-batch is taken by
Megatron-Core's per-token-loss normalisation (micro-batches and DP ranks together).
"""

from __future__ import annotations

import math

import torch


def terms(lp: torch.Tensor, old_lp: torch.Tensor, rollout_lp: torch.Tensor | None, adv: torch.Tensor,
          mask: torch.Tensor, cfg):
    from megatron_bridge.trainer import LossTerms

    mask = mask.to(lp.dtype)
    log_ratio = lp - old_lp
    ratio = torch.exp(log_ratio)
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(surr1, surr2)
    clipped_low = ((ratio < 1.0 - cfg.eps_low) & (adv < 0)).to(lp.dtype)
    clipped_high = ((ratio > 1.0 + cfg.eps_high) & (adv > 0)).to(lp.dtype)
    dual = torch.zeros_like(pg)
    if cfg.dual_clip_c is not None and math.isfinite(cfg.dual_clip_c):
        bound = -adv * cfg.dual_clip_c
        dual = ((adv < 0) & (pg > bound)).to(lp.dtype)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    stats = {}
    if cfg.use_tis and rollout_lp is not None:
        with torch.no_grad():
            w_raw = torch.exp(old_lp - rollout_lp)
            cap = cfg.tis_cap if cfg.tis_cap is not None else math.inf
            w = w_raw.clamp(max=cap)
        pg = pg * w
        stats["tis_weight_sum"] = (w * mask).sum()
        stats["tis_clipfrac_sum"] = ((w_raw > cap).to(lp.dtype) * mask).sum()
    loss_sum = (pg * mask).sum()
    with torch.no_grad():
        stats.update(
            loss_sum=loss_sum.detach(),
            clipfrac_low_sum=(clipped_low * mask).sum(),
            clipfrac_high_sum=(clipped_high * mask).sum(),
            clipfrac_dual_sum=(dual * mask).sum(),
            ratio_sum=(ratio * mask).sum(),
            approx_kl_sum=((-log_ratio) * mask).sum(),
        )
    return LossTerms(loss_sum=loss_sum, stats=stats)
