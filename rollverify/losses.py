"""GRPO advantages and policy losses over per-token tensors with a validity mask.

The main objective (the paper's setup; VeRL's conventions where it is silent):

    r   = exp(lp - lp_old)                          lp_old: recomputed by the trainer before the step
    l   = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))          decoupled clipping
    l   = min(l, -A c)            where A < 0                         dual clip (c = inf: off)
    w   = min(exp(lp_old - lp_rollout), C), detached                  truncated importance sampling
    L   = sum(w l over valid tokens) / num_valid_tokens               token-mean

GSPO, SAPO and VESPO are the loss-level alternatives; every loss takes the same per-token TIS weight ``w`` on
each token's loss. Aggregation follows VeRL's ``agg_loss`` (``aggregate``): token-mean, seq-mean-token-mean or
seq-mean-token-sum, each loss defaulting to VeRL's choice for it (``DEFAULT_AGG``). The normaliser
(``global_count``) is the count of the whole mini-batch (every micro-batch, every data-parallel rank: valid
tokens, or sequences with a valid token), so that summing the micro-batch gradients gives the mini-batch mean;
it is never the sum of weights. All math runs in float32 (float64 stays float64), so bf16 inputs are safe;
masked positions may hold any value, even NaN.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from rollverify.sections import ConfigError, bounded, check_bounds

# --- the stale-token correction setting ---------------------------------------------------------------------
#
# What the trainer does about tokens the engine sampled under an older (or numerically different) policy than
# the trainer's: a per-token behaviour weight and a loss mask (`behaviour_correction`), or slime's mask of the
# carried-over tokens. Notation: lp_old is the trainer's recomputed log-prob (AReaL's proximal policy),
# lp_rollout the engine's (the behaviour policy), r = exp(lp_old - lp_rollout) per token.

Weighting = Literal["none", "tis", "decoupled", "icepop", "m2po", "seq_mis", "geo_rs"]
Correction = Literal[Weighting, "mask_offpolicy"]
CORRECTIONS: tuple[str, ...] = typing.get_args(Correction)
WEIGHTS: tuple[str, ...] = typing.get_args(Weighting)[1:]  # the methods that weigh by the engine's log-probs
SEQUENCE_CORRECTIONS = ("seq_mis", "geo_rs")  # they need padded [sequences, tokens] tensors


@dataclass
class CorrectionConfig:
    """The trainer's stale-token correction (the `trainer.correction` section): one `method` and its knobs.

    ``none``            no correction: every token weighs 1 and the engine's log-probs are not read.
    ``tis``             truncated importance sampling, w = min(r, tis_cap) (the design's; each loss applies it).
    ``decoupled`` ...   a weight and loss mask that replace TIS (`behaviour_correction` gives each's source):
                        decoupled and m2po (AReaL), icepop (slime), seq_mis and geo_rs (verl's presets).
    ``mask_offpolicy``  slime's --mask-offpolicy-in-partial-rollout: tokens sampled by an older policy version
                        than the trainer's (the carried-over ones) leave the loss mask; `then` weighs the tokens
                        it keeps (none, or one of the weights above).
    """

    method: Correction = "tis"
    then: Weighting = "none"  # mask_offpolicy only: what weighs the tokens the mask keeps
    tis_cap: float = bounded(2.0, gt=0.0)  # tis: the cap C; inf: untruncated
    decoupled_cap: float = bounded(5.0, gt=0.0)  # decoupled, m2po: behaviour weights above it are rejected (0)
    icepop_low: float = bounded(0.5, ge=0.0)  # icepop: weights outside [low, high] are 0
    icepop_high: float = bounded(2.0, gt=0.0)
    m2_threshold: float = bounded(0.04, gt=0.0)  # m2po: mean (log r)^2 of the kept tokens stays below it
    seq_is_cap: float = bounded(2.0, gt=0.0)  # seq_mis: sequence IS weight cap
    seq_rs_low: float = bounded(0.5, gt=0.0)  # seq_mis: a sequence stays where low <= prod_t 1/r_t <= high
    seq_rs_high: float = bounded(2.0, gt=0.0)
    geo_rs_low: float = bounded(0.999, gt=0.0)  # geo_rs: a sequence stays where its geometric mean of 1/r
    geo_rs_high: float = bounded(1.001, gt=0.0)  # ... lies in [low, high]

    BANDS: ClassVar[tuple[tuple[str, str], ...]] = (("icepop_low", "icepop_high"), ("seq_rs_low", "seq_rs_high"),
                                                    ("geo_rs_low", "geo_rs_high"))

    def check(self, prefix: str = "trainer.correction") -> None:
        """Names, bounds and the rules between the knobs; `ConfigError` naming the key."""
        if self.method not in CORRECTIONS:
            raise ConfigError(f"{prefix}.method: one of {', '.join(CORRECTIONS)}, got {self.method!r}")
        if self.then not in ("none", *WEIGHTS):
            raise ConfigError(f"{prefix}.then: one of none, {', '.join(WEIGHTS)}, got {self.then!r}")
        if self.then != "none" and self.method != "mask_offpolicy":
            raise ConfigError(f"{prefix}.then: weighs the tokens slime's mask keeps, so it needs {prefix}.method="
                              f"mask_offpolicy (method is {self.method}); for {self.then} alone set "
                              f"{prefix}.method={self.then} and {prefix}.then=none")
        check_bounds(self, prefix)
        for lo, hi in self.BANDS:
            if getattr(self, lo) > getattr(self, hi):
                raise ConfigError(f"{prefix}.{lo}: must be <= {prefix}.{hi} ({getattr(self, hi)}), "
                                  f"got {getattr(self, lo)}")

    @property
    def weighting(self) -> str | None:
        """The weight the loss takes: one of `WEIGHTS`, or None (every token weighs 1)."""
        w = self.then if self.method == "mask_offpolicy" else self.method
        return None if w == "none" else w

    @property
    def masks_offpolicy(self) -> bool:
        """Whether tokens of older policy versions than the trainer's leave the loss mask."""
        return self.method == "mask_offpolicy"

    @property
    def reads_rollout_logprobs(self) -> bool:
        """Whether the loss reads the engine's log-probs (every weighting does; the mask alone does not)."""
        return self.weighting is not None


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# VeRL's aggregation per loss: token-mean for the PPO surrogate (actor.loss_agg_mode's default) and for VESPO
# (its authors' recipe runs on that default); GSPO and SAPO aggregate seq-mean-token-mean.
DEFAULT_AGG = {"ppo": "token-mean", "gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "vespo": "token-mean"}


def grpo_advantages(rewards: Tensor, use_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages for rewards [groups, n]: A = (r - mean) / (std + eps) per group.

    std is the unbiased one; ``use_std=False`` keeps only r - mean (Dr. GRPO). As in VeRL, a group of one
    response uses mean 0 and std 1.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    r = rewards.to(_compute_dtype(rewards))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite (every response of a group needs its reward)")
    if r.shape[1] == 1:
        mean, std = torch.zeros_like(r), torch.ones_like(r)
    else:
        mean, std = r.mean(1, keepdim=True), r.std(1, keepdim=True)
    return (r - mean) / (std + eps) if use_std else r - mean


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def aggregate(loss: Tensor, valid: Tensor, mode: str, global_count: int | None = None) -> Tensor:
    """VeRL's ``agg_loss`` of per-token losses (masked positions ignored):

        token-mean            sum_i sum_t l_i,t / N_tokens
        seq-mean-token-mean   sum_i (sum_t l_i,t / |y_i|) / N_seqs
        seq-mean-token-sum    sum_i sum_t l_i,t / N_seqs

    N_tokens (valid tokens) or N_seqs (sequences with a valid token) is ``global_count`` when given, else this
    call's own. The sequence modes need padded [batch, tokens] tensors.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    terms = torch.where(valid, loss, 0.0)
    if mode == "token-mean":
        return terms.sum() / _count(global_count, valid)
    if loss.dim() != 2:
        raise ValueError(f"loss_agg_mode {mode} needs padded [batch, tokens] tensors, got shape {tuple(loss.shape)}")
    per_seq = terms.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / valid.sum(-1).clamp(min=1)
    return per_seq.sum() / _count(global_count, valid.any(-1))


def ppo_tis_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.3,
    dual_clip_c: float = 3.0,
    tis_cap: float = CorrectionConfig.tis_cap,
    agg_mode: str | None = None,
    global_count: int | None = None,
    behaviour_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO surrogate with decoupled and dual clipping, TIS-weighted (module doc); token-mean.

    Tensors share one shape (e.g. packed [N] or padded [B, T]); ``rollout_logprobs=None`` skips TIS.
    Returns (loss, detached metrics).
    """
    if not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c must be > 1 (inf turns it off), got {dual_clip_c!r}")
    lp, old, adv, valid = _prepare(logprobs, old_logprobs, advantages, mask)
    log_ratio = (lp - old).clamp(-20.0, 20.0)  # VeRL's bound: keeps exp finite for garbage inputs
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    if dual_clip_c < math.inf:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip_c), loss)
    total, metrics = _weigh_and_aggregate(loss, old, rollout_logprobs, valid, tis_cap,
                                          agg_mode or DEFAULT_AGG["ppo"], global_count, behaviour_weight)
    with torch.no_grad():
        metrics |= {
            "clip_frac_high": masked_mean(((adv > 0) & (ratio > 1 + eps_high)).to(lp.dtype), valid),
            "clip_frac_low": masked_mean(((adv < 0) & (ratio < 1 - eps_low)).to(lp.dtype), valid),
            "dual_clip_frac": masked_mean(((adv < 0) & (ratio > dual_clip_c)).to(lp.dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "approx_kl": masked_mean(-log_ratio, valid),
        }
    return total, metrics


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float = CorrectionConfig.tis_cap,
    agg_mode: str | None = None,
    global_count: int | None = None,
    behaviour_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025) in its GSPO-token form, on padded [B, T] tensors:

        s_i    = exp(mean_t (lp - lp_old))                      sequence ratio, length-normalised
        s_i,t  = sg[s_i] exp(lp_t - sg[lp_t])                   value s_i, gradient of s_i per token
        l_i,t  = w_i,t max(-A s_i,t, -A clip(s_i,t, 1 - eps_low, 1 + eps_high))
        L      = sum_i mean_t l_i,t / N_seqs                    seq-mean-token-mean (VeRL's default)

    w_i,t is the per-token TIS weight of the module doc, as VeRL and the design apply it.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"gspo_loss needs padded [batch, tokens] tensors, got shape {tuple(logprobs.shape)}")
    lp, old, adv, valid = _prepare(logprobs, old_logprobs, advantages, mask)
    m = valid.to(lp.dtype)
    seq_len = m.sum(-1)
    seq_log_ratio = ((lp - old) * m).sum(-1) / seq_len.clamp(min=1)
    log_s = (lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    loss = torch.maximum(-adv * s, -adv * s.clamp(1 - eps_low, 1 + eps_high))
    total, metrics = _weigh_and_aggregate(loss, old, rollout_logprobs, valid, tis_cap,
                                          agg_mode or DEFAULT_AGG["gspo"], global_count, behaviour_weight)
    with torch.no_grad():
        clipped = ((adv > 0) & (s > 1 + eps_high)) | ((adv < 0) & (s < 1 - eps_low))
        metrics |= {
            "clip_frac": masked_mean(clipped.to(lp.dtype), valid),
            "seq_ratio_mean": masked_mean(torch.exp(seq_log_ratio), seq_len > 0),
        }
    return total, metrics


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float = CorrectionConfig.tis_cap,
    agg_mode: str | None = None,
    global_count: int | None = None,
    behaviour_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025): a soft, temperature-controlled gate instead of the hard clip.

        r = exp(lp - lp_old);  tau = tau_pos if A > 0 else tau_neg
        f(r) = 4/tau sigmoid(tau (r - 1))         f'(1) = 1: the plain policy gradient on-policy
        l_i,t = -w_i,t f(r_i,t) A_i
        L = sum_i mean_t l_i,t / N_seqs           seq-mean-token-mean (VeRL's default)

    Its default aggregation needs padded [B, T] tensors; token-mean also takes packed [N] ones.
    """
    lp, old, adv, valid = _prepare(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp((lp - old).clamp(-20.0, 20.0))
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # the compute dtype
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1))
    total, metrics = _weigh_and_aggregate(-gate * adv, old, rollout_logprobs, valid, tis_cap,
                                          agg_mode or DEFAULT_AGG["sapo"], global_count, behaviour_weight)
    with torch.no_grad():
        p = torch.sigmoid(tau * (ratio - 1))
        metrics |= {
            "ratio_mean": masked_mean(ratio, valid),
            "gate_grad_weight_mean": masked_mean(4 * p * (1 - p), valid),  # 1 on-policy, -> 0 far off
        }
    return total, metrics


def vespo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    c1_pos: float = 2.0,
    c2_pos: float = 3.0,
    c1_neg: float = 3.0,
    c2_neg: float = 2.0,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float = CorrectionConfig.tis_cap,
    agg_mode: str | None = None,
    global_count: int | None = None,
    behaviour_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO (Shen et al. 2026, arXiv 2602.10693): a smooth kernel on the sequence-level importance weight.

    The paper's estimator is REINFORCE-shaped, g = E_mu[phi(W) A grad log pi(y|x)], with

        W       = pi(y|x) / mu(y|x) = exp(sum_t (lp_t - lp_old,t))   sequence weight, NOT length-normalised
        phi(W)  = W^c1 exp(c2 (1 - W))                               its reshaping kernel: phi(1) = 1, a gamma
                                                                     shape peaking at W = c1/c2, -> 0 as W -> inf
        (c1, c2) = (c1_pos, c2_pos) where A >= 0, (c1_neg, c2_neg) where A < 0   (asymmetric)

    phi(W) only scales the gradient (stop-gradient), so per token

        l_i,t = -w_i,t sg[phi(W_i)] A_i exp(lp_t - sg[lp_t])        value -w phi A, gradient -w phi A grad lp_t
        L     = sum_i,t l_i,t / N_tokens                            token-mean (the authors' verl recipe)

    w_i,t is the per-token TIS weight of the module doc, as the design applies it to every loss (the authors'
    verl recipe instead multiplies the truncated engine/trainer ratios into W). On-policy (W = 1) this is the
    plain policy gradient. phi is computed in log space (c1 log W + c2 (1 - W)), so a huge W gives phi = 0, never
    inf or NaN. Defaults: the (c1, c2) of the authors' recipe run scripts (recipe/vespo/run/sync/*.sh). The
    kernel is the paper's closed form phi(W) = W^{c1} e^{c2(1-W)}, its gamma kernel W^alpha e^{-lambda W} scaled
    to phi(1) = 1.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"vespo_loss needs padded [batch, tokens] tensors, got shape {tuple(logprobs.shape)}")
    for name, c in (("c1_pos", c1_pos), ("c1_neg", c1_neg)):
        if not c >= 0:
            raise ValueError(f"vespo {name} must be >= 0, got {c!r}")
    for name, c in (("c2_pos", c2_pos), ("c2_neg", c2_neg)):
        if not 0 < c < math.inf:
            raise ValueError(f"vespo {name} must be > 0 and finite, got {c!r}")
    lp, old, adv, valid = _prepare(logprobs, old_logprobs, advantages, mask)
    with torch.no_grad():
        log_w = torch.where(valid, (lp - old).clamp(-20.0, 20.0), 0.0).sum(-1)  # log W_i
        seq_adv = torch.where(valid, adv, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
        pos = seq_adv >= 0
        c1 = torch.where(pos, adv.new_tensor(c1_pos), adv.new_tensor(c1_neg))
        c2 = torch.where(pos, adv.new_tensor(c2_pos), adv.new_tensor(c2_neg))
        seq_w = torch.exp(log_w)  # may be inf: then c2 (1 - W) = -inf and phi = 0
        phi = torch.exp(c1 * log_w + c2 * (1 - seq_w))
    loss = -phi.unsqueeze(-1) * adv * torch.exp(lp - lp.detach())
    total, metrics = _weigh_and_aggregate(loss, old, rollout_logprobs, valid, tis_cap,
                                          agg_mode or DEFAULT_AGG["vespo"], global_count, behaviour_weight)
    with torch.no_grad():
        has = valid.any(-1)
        metrics |= {
            "seq_log_ratio_mean": masked_mean(log_w, has),
            "phi_mean": masked_mean(phi, has),
            "phi_max": phi[has].max() if has.any() else torch.zeros(()),
        }
    return total, metrics


# --- stale-token corrections ------------------------------------------------------------------------------
#
# Each correction's behaviour weight and loss mask, which a loss above takes in place of its TIS weight (the
# notation is `CorrectionConfig`'s); log r is clamped to +-20 as verl does.

_LOG_BOUND = 20.0


def behaviour_correction(
    cfg: CorrectionConfig,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The behaviour weight w (detached, 0 where a token is rejected but still counted) and the loss mask
    ``keep`` (False where the method takes a token out of the loss mask, so out of the normaliser too) of the
    weighting `cfg` names (`CorrectionConfig.weighting`, its knobs `cfg`'s), with its statistics (``corr_*``).
    Each definition is its source's:

    ``tis``        w = min(r, tis_cap), keep all: the design's truncated IS (slime ``vanilla_tis_function``
                   with tis_clip_low 0, verl token TIS).
    ``decoupled``  AReaL's decoupled PPO (`areal/utils/functional/functional.py`, ``ppo_actor_loss_fn`` with
                   ``apply_rejection_sampling`` at its defaults: token level, action mask, metric ratio): the
                   PPO ratio is taken against the proximal policy (lp_old, recomputed), and each token's loss
                   is multiplied by the behaviour weight r = pi_prox / pi_behave; tokens with r > decoupled_cap
                   (``rejection_sampling.upper``, 5.0 in AReaL's examples) get weight 0. The normaliser stays
                   the count before the rejection, as AReaL's ``loss_mask_count``.
    ``icepop``     slime's IcePop (`slime/backends/megatron_utils/loss.py`, ``icepop_function``): w = r where
                   icepop_low <= r <= icepop_high (``--tis-clip-low`` / ``--tis-clip``, 0.5 / 2.0 in slime's
                   IcePop test), else 0; the loss mask is unchanged.
    ``m2po``       M2PO as AReaL implements it (`areal/trainer/ppo/actor.py`, ``_apply_m2po_masking`` and
                   ``_get_m2po_loss_mask``): m2 = (lp_rollout - lp_old)^2 per valid token; the tokens of
                   largest m2 leave the loss mask, fewest first, until the mean m2 of the rest is below
                   m2_threshold (all but one when no count reaches it). On the kept tokens the weight is
                   ``decoupled``'s, as AReaL's M2PO example runs it (examples/math/gsm8k_m2po.yaml:
                   use_decoupled_loss, rejection upper 5.0, m2_threshold 0.04). Applied per call, i.e. per
                   micro-batch, where AReaL's loss function applies it.
    ``seq_mis``    verl's ``RolloutCorrectionConfig.decoupled_seq_is_rs`` preset (`verl/trainer/config/
                   algorithm.py`; `verl/trainer/ppo/rollout_corr_helper.py`, ``compute_rollout_correction_
                   weights`` and ``compute_rollout_rejection_mask``): sequence IS weight min(exp(sum_t log r),
                   seq_is_cap) on every token of the sequence, and the ``seq_sum_k1`` rejection: a sequence
                   stays in the loss mask where log(seq_rs_low) <= -sum_t log r <= log(seq_rs_high).
    ``geo_rs``     verl's ``decoupled_geo_rs`` preset: no IS weight (w = 1) and the ``seq_mean_k1`` rejection:
                   a sequence stays where log(geo_rs_low) <= -mean_t log r <= log(geo_rs_high) (0.999 / 1.001).

    Tensors share one shape (``seq_mis`` and ``geo_rs``: padded [B, T]); masked positions may hold anything.
    """
    cfg.check(prefix="correction")
    kind = cfg.weighting
    if kind is None:
        raise ValueError(f"the correction {cfg.method}"
                         + (" then none" if cfg.masks_offpolicy else "") + " weighs no token by the engine's log-probs")
    if old_logprobs.shape != rollout_logprobs.shape or mask.shape != old_logprobs.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must share one shape")
    if kind in SEQUENCE_CORRECTIONS and old_logprobs.dim() != 2:
        raise ValueError(f"the {kind} correction needs padded [batch, tokens] tensors, got shape "
                         f"{tuple(old_logprobs.shape)}")
    valid = mask.bool()
    dtype = _compute_dtype(old_logprobs)
    with torch.no_grad():
        log_r = torch.where(valid, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), 0.0)
        log_r = torch.nan_to_num(log_r, nan=0.0).clamp(-_LOG_BOUND, _LOG_BOUND)
        r = torch.exp(log_r)
        keep = valid.clone()
        if kind == "tis":
            w = r.clamp(max=cfg.tis_cap)
        elif kind == "icepop":
            w = torch.where((r >= cfg.icepop_low) & (r <= cfg.icepop_high), r, 0.0)
        elif kind in ("decoupled", "m2po"):
            w = torch.where(r <= cfg.decoupled_cap, r, 0.0)
            if kind == "m2po":
                keep = _m2po_keep(log_r, valid, cfg.m2_threshold)
        elif kind == "seq_mis":
            seq_log = log_r.sum(-1, keepdim=True)  # log prod_t r_t
            w = torch.exp(seq_log.clamp(-_LOG_BOUND, _LOG_BOUND)).clamp(max=cfg.seq_is_cap).expand_as(log_r)
            keep = valid & _in_log_band(-seq_log, cfg.seq_rs_low, cfg.seq_rs_high)
        else:  # geo_rs
            w = torch.ones_like(r)
            seq_mean = log_r.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
            keep = valid & _in_log_band(-seq_mean, cfg.geo_rs_low, cfg.geo_rs_high)
        w = torch.where(keep, w, 0.0)
        metrics = {
            "corr_weight_mean": masked_mean(w, valid),
            "corr_zero_weight_frac": masked_mean((w == 0).to(dtype), valid),  # rejected, masked or not
            "corr_loss_masked_frac": masked_mean((~keep).to(dtype), valid),  # out of the loss mask
        }
    return w, keep, metrics


def _in_log_band(stat: Tensor, low: float, high: float) -> Tensor:
    """verl's k1 bounds: log(low) <= stat <= log(high) (low 0: no lower bound)."""
    lower = math.log(low) if low > 0 else -math.inf
    return (stat >= lower) & (stat <= math.log(high))


def _m2po_keep(log_r: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """AReaL's M2PO mask: drop the k valid tokens of largest (log r)^2, k the smallest count after which the
    mean of the rest is below `threshold` (n - 1 when none is)."""
    m2 = torch.square(log_r[valid])
    keep = valid.clone()
    n = m2.numel()
    if n == 0:
        return keep
    order = torch.argsort(m2, descending=True, stable=True)
    suffix_mean = m2[order].flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)
    below = torch.nonzero(suffix_mean < threshold)
    k = int(below[0]) if below.numel() else n - 1
    kept = torch.ones(n, dtype=torch.bool, device=m2.device)
    kept[order[:k]] = False
    keep[valid] = kept
    return keep


# --- helpers ----------------------------------------------------------------------------------------------


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prepare(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cast to the compute dtype, broadcast [B] advantages, and zero masked positions (no NaN leaks)."""
    if old.shape != lp.shape:
        raise ValueError(f"old_logprobs must be shaped like logprobs {tuple(lp.shape)}, got {tuple(old.shape)}")
    if mask.shape != lp.shape:
        raise ValueError(f"mask must be shaped like logprobs {tuple(lp.shape)}, got {tuple(mask.shape)}")
    if adv.shape != lp.shape:
        if lp.dim() == 2 and adv.shape == lp.shape[:1]:
            adv = adv.unsqueeze(-1).expand_as(lp)
        else:
            raise ValueError(
                f"advantages must be per token {tuple(lp.shape)} or per sequence {tuple(lp.shape[:1])}, "
                f"got {tuple(adv.shape)}"
            )
    dtype = _compute_dtype(lp)
    valid = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    return (
        torch.where(valid, lp.to(dtype), zero),
        torch.where(valid, old.to(dtype), zero).detach(),
        torch.where(valid, adv.to(dtype), zero).detach(),
        valid,
    )


def _tis(old: Tensor, rollout: Tensor | None, valid: Tensor, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token TIS weights w = min(exp(lp_old - lp_rollout), C), detached, and their statistics."""
    if rollout is None:
        return torch.ones_like(old), {}
    if rollout.shape != old.shape:
        raise ValueError(f"rollout_logprobs must be shaped like logprobs {tuple(old.shape)}, got {tuple(rollout.shape)}")
    if not cap > 0:
        raise ValueError(f"tis_cap must be > 0 (inf: no truncation), got {cap!r}")
    with torch.no_grad():
        log_w = torch.where(valid, old - rollout.to(old.dtype), 0.0)
        w = torch.exp(log_w.clamp(max=math.log(cap) if cap < math.inf else 20.0))
        w = torch.where(valid, w, 0.0)
        metrics = {
            "tis_weight_mean": masked_mean(w, valid),
            "tis_weight_max": w.max() if w.numel() else torch.zeros(()),
            "tis_frac_capped": masked_mean((log_w >= math.log(cap)).to(old.dtype), valid),
        }
    return w, metrics


def _weigh_and_aggregate(
    loss: Tensor, old: Tensor, rollout: Tensor | None, valid: Tensor, tis_cap: float, mode: str,
    global_count: int | None, behaviour_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Every loss's tail: per-token losses times their TIS weights (or ``behaviour_weight``, a stale-token
    correction's, when given: `behaviour_correction`), aggregated per `mode`; the TIS statistics and the result
    as ``pg_loss``."""
    if behaviour_weight is not None:
        if behaviour_weight.shape != loss.shape:
            raise ValueError(f"behaviour_weight must be shaped like logprobs {tuple(loss.shape)}, "
                             f"got {tuple(behaviour_weight.shape)}")
        w, metrics = torch.where(valid, behaviour_weight.detach().to(loss.dtype), 0.0), {}
    else:
        w, metrics = _tis(old, rollout, valid, tis_cap)
    total = aggregate(w * loss, valid, mode, global_count)
    metrics["pg_loss"] = total.detach()
    return total, metrics


def _count(given: int | None, valid: Tensor) -> float | Tensor:
    if given is None:
        return valid.sum().clamp(min=1)
    if given < 1:
        raise ValueError(f"the global valid count must be >= 1, got {given}")
    return float(given)
