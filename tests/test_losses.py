"""Advantages and losses against hand-computed values, finite-difference gradients, dtype stability."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollverify.losses import (
    AGG_MODES,
    DEFAULT_AGG,
    aggregate,
    grpo_advantages,
    gspo_loss,
    masked_mean,
    ppo_tis_loss,
    sapo_loss,
    vespo_loss,
)

F64 = torch.float64


def t(x, dtype=F64, **kw):
    return torch.tensor(x, dtype=dtype, **kw)


# --- advantages -------------------------------------------------------------------------------------------


def test_grpo_advantages_hand_values():
    a = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), eps=0.0 + 1e-6)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    torch.testing.assert_close(a[0], t([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert a[1].tolist() == [0.0] * 4  # equal rewards: no signal
    torch.testing.assert_close(grpo_advantages(t([[1.0, 0.0]]), use_std=False), t([[0.5, -0.5]]))
    torch.testing.assert_close(grpo_advantages(t([[3.0]])), t([[3.0 / (1 + 1e-6)]]))  # VeRL: n=1 -> mean 0, std 1


def test_grpo_advantages_bad_input():
    with pytest.raises(ValueError, match=r"rewards must be \[groups, n\]"):
        grpo_advantages(t([1.0, 0.0]))
    with pytest.raises(ValueError, match="rewards must be finite"):
        grpo_advantages(t([[1.0, math.nan]]))


def test_masked_mean():
    assert masked_mean(t([1.0, 5.0, 3.0]), torch.tensor([True, False, True])).item() == 2.0
    assert masked_mean(t([1.0]), torch.tensor([False])).item() == 0.0


# --- PPO + TIS --------------------------------------------------------------------------------------------


def ppo_case():
    """Four valid tokens (unclipped, high clip, low clip, dual clip) and one masked garbage token."""
    old = t([-1.0, -1.0, -1.0, -1.0, 0.0])
    lp = (old + t([0.0, math.log(1.5), math.log(0.5), math.log(4.0), math.nan])).requires_grad_()
    adv = t([2.0, 1.0, -1.0, -1.0, math.nan])
    rollout = old - t([0.0, math.log(3.0), 0.0, math.log(0.5), 0.0])  # TIS w = [1, min(3, 2), 1, 0.5]
    mask = torch.tensor([True, True, True, True, False])
    return lp, old, rollout, adv, mask


def test_ppo_tis_hand_values():
    lp, old, rollout, adv, mask = ppo_case()
    loss, m = ppo_tis_loss(lp, old, rollout, adv, mask, eps_low=0.2, eps_high=0.3, dual_clip_c=3.0, tis_cap=2.0)
    # per-token clipped losses: -2*1, max(-1.5, -1.3) = -1.3, max(0.5, 0.8) = 0.8, min(max(4, 1.3), 3) = 3
    expect = (1 * -2.0 + 2 * -1.3 + 1 * 0.8 + 0.5 * 3.0) / 4
    assert loss.item() == pytest.approx(expect)
    assert m["clip_frac_high"].item() == m["clip_frac_low"].item() == m["dual_clip_frac"].item() == 0.25
    assert m["tis_weight_mean"].item() == pytest.approx((1 + 2 + 1 + 0.5) / 4)
    assert m["tis_weight_max"].item() == pytest.approx(2.0)
    assert m["tis_frac_capped"].item() == 0.25
    loss.backward()
    # Only the unclipped token has a gradient: d/dlp (-A r w) / 4 = -2 * 1 * 1 / 4.
    assert lp.grad.tolist() == pytest.approx([-0.5, 0.0, 0.0, 0.0, 0.0])


def test_ppo_global_token_count_and_switches():
    lp, old, rollout, adv, mask = ppo_case()
    loss, _ = ppo_tis_loss(lp, old, rollout, adv, mask, global_count=10)
    assert loss.item() == pytest.approx((-2.0 - 2.6 + 0.8 + 1.5) / 10)
    no_dual, _ = ppo_tis_loss(lp, old, rollout, adv, mask, dual_clip_c=math.inf)
    assert no_dual.item() == pytest.approx((-2.0 - 2.6 + 0.8 + 0.5 * 4.0) / 4)
    no_tis, m = ppo_tis_loss(lp, old, None, adv, mask)
    assert no_tis.item() == pytest.approx((-2.0 - 1.3 + 0.8 + 3.0) / 4) and "tis_weight_mean" not in m
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_tis_loss(lp, old, rollout, adv, mask, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="global valid count must be >= 1"):
        ppo_tis_loss(lp, old, rollout, adv, mask, global_count=0)
    with pytest.raises(ValueError, match="mask must be shaped like logprobs"):
        ppo_tis_loss(lp, old, rollout, adv, mask[:3])
    with pytest.raises(ValueError, match="rollout_logprobs must be shaped like logprobs"):
        ppo_tis_loss(lp, old, rollout[:3], adv, mask)


def test_micro_batches_with_the_global_count_sum_to_the_full_batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 10, generator=g, dtype=F64)
    lp = (old + 0.3 * torch.randn(2, 10, generator=g, dtype=F64)).requires_grad_()
    rollout = old + 0.2 * torch.randn(2, 10, generator=g, dtype=F64)
    adv = torch.randn(2, generator=g, dtype=F64)
    mask = torch.rand(2, 10, generator=g) > 0.3
    full, _ = ppo_tis_loss(lp, old, rollout, adv, mask)
    (full_grad,) = torch.autograd.grad(full, lp)
    n = int(mask.sum())
    parts = [ppo_tis_loss(lp[i : i + 1], old[i : i + 1], rollout[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                          global_count=n)[0] for i in range(2)]
    (part_grad,) = torch.autograd.grad(sum(parts), lp)
    torch.testing.assert_close(sum(parts), full)
    torch.testing.assert_close(part_grad, full_grad)


def test_tis_weight_is_detached_and_uses_the_recomputed_old_logprob():
    lp, old, rollout, adv, mask = ppo_case()
    old, rollout = old.clone().requires_grad_(), rollout.clone().requires_grad_()
    loss, _ = ppo_tis_loss(lp, old, rollout, adv, mask)
    loss.backward()
    assert old.grad is None and rollout.grad is None
    # Shifting the current log-prob leaves w alone: w depends on lp_old - lp_rollout only.
    _, m1 = ppo_tis_loss(lp + 0.05, old, rollout, adv, mask)
    _, m0 = ppo_tis_loss(lp, old, rollout, adv, mask)
    assert m1["tis_weight_mean"].item() == m0["tis_weight_mean"].item()


def random_inputs(seed, shape=(3, 7), dtype=F64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(*shape, generator=g, dtype=dtype) * 3
    lp = (old + 0.15 * torch.randn(*shape, generator=g, dtype=dtype)).requires_grad_()
    rollout = old + 0.3 * torch.randn(*shape, generator=g, dtype=dtype)
    adv = torch.randn(shape[0], generator=g, dtype=dtype)
    mask = torch.rand(*shape, generator=g) > 0.25
    mask[:, 0] = True
    return lp, old, rollout, adv, mask


@pytest.mark.parametrize("seed", range(4))
def test_finite_difference_gradients(seed):
    lp, old, rollout, adv, mask = random_inputs(seed)
    tok_adv = adv[:, None].expand_as(lp)
    checks = {
        "ppo": lambda x: ppo_tis_loss(x, old, rollout, tok_adv, mask, dual_clip_c=1.5)[0],
        # GSPO without TIS: a per-token weight makes its token gradients differ from the value's on purpose
        "gspo": lambda x: gspo_loss(x, old, adv, mask, eps_low=0.05, eps_high=0.05)[0],
        "sapo": lambda x: sapo_loss(x, old, tok_adv, mask, rollout_logprobs=rollout)[0],
    }
    for name, f in checks.items():
        assert torch.autograd.gradcheck(f, (lp,), eps=1e-7, atol=1e-6), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stable_for_low_precision_inputs(dtype):
    lp, old, rollout, adv, mask = random_inputs(7)
    ref = ppo_tis_loss(lp, old, rollout, adv, mask)[0]
    low = lp.detach().to(dtype).requires_grad_()
    loss, m = ppo_tis_loss(low, old.to(dtype), rollout.to(dtype), adv.to(dtype), mask)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(ref.item(), abs=0.05 if dtype == torch.bfloat16 else 1e-5)
    loss.backward()
    assert low.grad.dtype == dtype and torch.isfinite(low.grad.float()).all()
    for f in (gspo_loss, sapo_loss, vespo_loss):
        out, _ = f(low, old.to(dtype), adv.to(dtype), mask)
        assert out.dtype == torch.float32 and torch.isfinite(out)


def test_extreme_log_prob_gaps_stay_finite():
    lp = t([0.0, -200.0, 0.0], requires_grad=True)
    old = t([-200.0, 0.0, -math.inf])
    mask = torch.tensor([True, True, False])
    loss, m = ppo_tis_loss(lp, old, old + 50.0, t([1.0, -1.0, 1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


# --- GSPO and SAPO ----------------------------------------------------------------------------------------


def test_gspo_hand_values():
    old = t([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    # Token gaps +0.1 and -0.1: sequence ratio exp(0) = 1, unclipped; L = -A s = -2.
    lp = (old + t([[0.1, -0.1, 5.0]])).requires_grad_()
    loss, m = gspo_loss(lp, old, t([2.0]), mask)
    assert loss.item() == pytest.approx(-2.0) and m["seq_ratio_mean"].item() == pytest.approx(1.0)
    loss.backward()
    # dL/dlp_t = -A s / |y| for every valid token (the sequence ratio's gradient), 0 for the masked one.
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -1.0, 0.0])
    # Gaps +0.01 each: s = exp(0.01) > 1 + 4e-4 with A > 0: clipped to 1.0004, no gradient.
    lp = (old + t([[0.01, 0.01, 0.0]])).requires_grad_()
    loss, m = gspo_loss(lp, old, t([1.0]), mask)
    assert loss.item() == pytest.approx(-1.0004) and m["clip_frac"].item() == 1.0
    loss.backward()
    assert lp.grad.abs().sum().item() == 0.0


def test_gspo_sequence_mean_over_the_global_sequence_count():
    old = t([[-1.0, -1.0], [-1.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, _ = gspo_loss(old.clone(), old, t([1.0, 3.0]), mask, global_count=4)
    assert loss.item() == pytest.approx((-1.0 - 3.0) / 4)
    with pytest.raises(ValueError, match=r"gspo_loss needs padded \[batch, tokens\]"):
        gspo_loss(old[0], old[0], t([1.0, 1.0]), mask[0])


def test_sapo_hand_values():
    old = t([-1.0, -1.0, -1.0])
    lp = old.clone().requires_grad_()  # r = 1: f(1) = 4/tau * sigmoid(0) = 2/tau
    adv = t([1.0, -1.0, 0.5])
    loss, m = sapo_loss(lp, old, adv, torch.tensor([True, True, False]), tau_pos=1.0, tau_neg=2.0,
                        agg_mode="token-mean")
    assert loss.item() == pytest.approx((-1.0 * 2 / 1.0 + 1.0 * 2 / 2.0) / 2)
    loss.backward()
    # On-policy the gate's slope is 1: the plain policy-gradient -A r / count.
    assert lp.grad.tolist() == pytest.approx([-0.5, 0.5, 0.0])
    assert m["gate_grad_weight_mean"].item() == pytest.approx(1.0)


def test_sapo_gate_attenuates_far_off_policy_tokens():
    old = t([-1.0, -1.0])
    lp = (old + t([0.0, math.log(5.0)])).requires_grad_()
    loss, _ = sapo_loss(lp, old, t([1.0, 1.0]), torch.tensor([True, True]), agg_mode="token-mean")
    loss.backward()
    near, far = lp.grad.abs().tolist()
    # far: -A * 4 p (1 - p) * r / 2 with p = sigmoid(4): much smaller than the on-policy -A / 2
    p = 1 / (1 + math.exp(-4.0))
    assert far == pytest.approx(4 * p * (1 - p) * 5.0 / 2) and far < near


# --- aggregation (VeRL's agg_loss) --------------------------------------------------------------------------


def test_aggregation_modes_hand_values():
    loss = t([[1.0, 2.0, 3.0], [4.0, 100.0, math.nan], [math.nan, math.nan, math.nan]])
    valid = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    # token-mean: (1 + 2 + 3 + 4) / 4 tokens; seq modes: the empty third row is no sequence
    assert aggregate(loss, valid, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, valid, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, valid, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # the mini-batch's count (other micro-batches, other ranks) replaces this call's own
    assert aggregate(loss, valid, "token-mean", global_count=8).item() == pytest.approx(10 / 8)
    assert aggregate(loss, valid, "seq-mean-token-mean", global_count=5).item() == pytest.approx(6 / 5)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        aggregate(loss, valid, "seq-mean")
    with pytest.raises(ValueError, match=r"seq-mean-token-sum needs padded \[batch, tokens\]"):
        aggregate(loss[0], valid[0], "seq-mean-token-sum")


def test_each_loss_defaults_to_verls_aggregation():
    assert set(DEFAULT_AGG.values()) <= set(AGG_MODES)
    assert DEFAULT_AGG == {"ppo": "token-mean", "gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean",
                           "vespo": "token-mean"}
    # Two sequences of 1 and 3 tokens, on-policy (r = 1), A = +1 and -1.
    old = t([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = t([1.0, -1.0])
    # SAPO per token: -f(1) A = -2/tau A -> -2 (A = +1, tau_pos 1) and +2/1.05 (A = -1, tau_neg 1.05)
    pos, neg = -2.0, 2.0 / 1.05
    sapo = {mode: sapo_loss(old.clone(), old, adv, mask, agg_mode=mode)[0].item() for mode in AGG_MODES}
    assert sapo_loss(old.clone(), old, adv, mask)[0].item() == sapo["seq-mean-token-mean"]
    assert sapo["seq-mean-token-mean"] == pytest.approx((pos + neg) / 2)
    assert sapo["token-mean"] == pytest.approx((pos + 3 * neg) / 4)
    assert sapo["seq-mean-token-sum"] == pytest.approx((pos + 3 * neg) / 2)
    # GSPO: -A s with s = 1 -> -1 and +1 per token
    assert gspo_loss(old.clone(), old, adv, mask)[0].item() == pytest.approx((-1 + 1) / 2)
    assert gspo_loss(old.clone(), old, adv, mask, agg_mode="token-mean")[0].item() == pytest.approx((-1 + 3) / 4)
    # PPO and VESPO: token-mean of -A r (VESPO: phi(1) = 1)
    assert ppo_tis_loss(old.clone(), old, None, adv, mask)[0].item() == pytest.approx((-1 + 3) / 4)
    assert vespo_loss(old.clone(), old, adv, mask)[0].item() == pytest.approx((-1 + 3) / 4)
    assert ppo_tis_loss(old.clone(), old, None, adv, mask, agg_mode="seq-mean-token-mean")[0].item() == 0.0


def test_seq_mean_micro_batches_with_the_global_count_sum_to_the_full_batch():
    lp, old, rollout, adv, mask = random_inputs(3, shape=(4, 6))
    for f in (sapo_loss, gspo_loss):
        full = f(lp, old, adv, mask, rollout_logprobs=rollout)[0]
        (full_grad,) = torch.autograd.grad(full, lp)
        parts = sum(f(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], rollout_logprobs=rollout[i : i + 2],
                      global_count=4)[0] for i in (0, 2))
        (part_grad,) = torch.autograd.grad(parts, lp)
        torch.testing.assert_close(parts, full)
        torch.testing.assert_close(part_grad, full_grad)


def test_gspo_applies_the_tis_weight_per_token():
    old = t([[-1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    rollout = old - t([[math.log(3.0), math.log(0.5), 0.0]])  # w = [min(3, 2), 0.5]
    lp = old.clone().requires_grad_()  # s = 1, unclipped
    loss, m = gspo_loss(lp, old, t([1.0]), mask, rollout_logprobs=rollout, tis_cap=2.0)
    # per token: -A s w_t -> mean_t (-2, -0.5); a sequence-level weight would give -min(exp(mean(log 3, log .5)), 2)
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2)
    assert m["tis_weight_mean"].item() == pytest.approx(1.25) and m["tis_frac_capped"].item() == 0.5
    loss.backward()
    # s_i,t has the gradient of s_i (1/|y| per token), scaled by the token's own weight: -A w_t / |y|
    assert lp.grad[0].tolist() == pytest.approx([-2.0 / 2, -0.5 / 2, 0.0])


def test_sapo_tau_keeps_float64():
    old = t([-1.0, -1.0])
    loss, _ = sapo_loss(old.clone(), old, t([-1.0, -1.0]), torch.tensor([True, True]), tau_neg=1.05,
                        agg_mode="token-mean")
    assert loss.dtype == F64
    assert abs(loss.item() - 2.0 / 1.05) < 1e-15  # a float32 tau (1.0499999523) is off by ~9e-8


# --- VESPO ------------------------------------------------------------------------------------------------


def test_vespo_kernel_hand_values():
    # sequence 0: A = +1, W = exp(log 2 + 0) = 2; sequence 1: A = -1, W = exp(2 * 0.5 log 2) = 2 (not length-normalised)
    old = t([[-1.0, -2.0, 0.0], [-1.0, -1.0, -3.0]])
    gaps = t([[math.log(2.0), 0.0, 0.0], [0.5 * math.log(2.0), 0.5 * math.log(2.0), math.nan]])
    lp = (old + gaps).requires_grad_()
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = t([1.0, -1.0])
    loss, m = vespo_loss(lp, old, adv, mask, c1_pos=2.0, c2_pos=3.0, c1_neg=3.0, c2_neg=2.0)
    phi_pos = 2.0**2 * math.exp(3.0 * (1 - 2.0))  # W^c1 exp(c2 (1 - W))
    phi_neg = 2.0**3 * math.exp(2.0 * (1 - 2.0))
    assert loss.item() == pytest.approx((2 * -phi_pos + 2 * phi_neg) / 4)  # token-mean of -phi A
    assert m["phi_mean"].item() == pytest.approx((phi_pos + phi_neg) / 2)
    assert m["seq_log_ratio_mean"].item() == pytest.approx(math.log(2.0))
    loss.backward()
    # phi only scales the gradient: dL/dlp_t = -phi A / N_tokens
    assert lp.grad.flatten().tolist() == pytest.approx([-phi_pos / 4] * 2 + [0.0] + [phi_neg / 4] * 2 + [0.0])


def test_vespo_is_the_policy_gradient_on_policy_and_vanishes_far_off():
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    lp = (old + t([[0.0, 0.0], [30.0, 30.0]])).requires_grad_()  # W = 1 and W = e^60
    rollout = old - t([[math.log(1.5), 0.0], [0.0, 0.0]])  # TIS w = [1.5, 1] on the first sequence
    loss, m = vespo_loss(lp, old, t([2.0, 2.0]), torch.ones(2, 2, dtype=torch.bool), rollout_logprobs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[0].tolist() == pytest.approx([-2.0 * 1.5 / 4, -2.0 / 4])  # phi(1) = 1: -w A / N
    assert lp.grad[1].tolist() == [0.0, 0.0]  # phi(e^60) underflows to 0
    assert m["phi_max"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="vespo c2_neg must be > 0"):
        vespo_loss(lp, old, t([1.0, 1.0]), torch.ones(2, 2, dtype=torch.bool), c2_neg=0.0)
    with pytest.raises(ValueError, match=r"vespo_loss needs padded \[batch, tokens\]"):
        vespo_loss(lp[0], old[0], t([1.0, 1.0]), torch.ones(2, dtype=torch.bool))


# --- the trainer's micro-batch terms (megatron_bridge.policy_loss) ---------------------------------------


@pytest.mark.parametrize("kind", ["ppo", "gspo", "sapo", "vespo"])
@pytest.mark.parametrize("mode", [None, *AGG_MODES])
def test_trainer_terms_over_micro_batches_equal_the_whole_batch(kind, mode):
    """What Megatron computes (sum of each micro-batch's loss_sum / sum of their counts) is the loss of the
    whole batch at once, for every loss and aggregation mode; None is the loss's default."""
    from megatron_bridge.config import TrainerConfig
    from megatron_bridge.policy_loss import _padded, terms
    from rollverify import losses

    cfg = TrainerConfig(loss=kind, loss_agg_mode=mode)
    g = torch.Generator().manual_seed(1)
    counts = [3, 5, 2, 4]
    n = sum(counts)
    old = -torch.rand(n, generator=g, dtype=F64) * 2
    lp = (old + 0.1 * torch.randn(n, generator=g, dtype=F64)).requires_grad_()
    rollout = old + 0.3 * torch.randn(n, generator=g, dtype=F64)
    adv = torch.repeat_interleave(t([1.0, -0.5, 2.0, -1.0]), torch.tensor(counts))
    mask = torch.ones(n, dtype=torch.bool)
    parts = [terms(lp[a:b], old[a:b], rollout[a:b], adv[a:b], mask[a:b], c, cfg)
             for (a, b), c in (((0, 8), [3, 5]), ((8, n), [2, 4]))]
    got = sum(p.loss_sum for p in parts) / sum(int(p.count) for p in parts)
    pad = [_padded(x, counts) for x in (lp, old, rollout, adv, mask)]
    fn = {"ppo": lambda *a, **k: losses.ppo_tis_loss(a[0], a[1], k.pop("rollout_logprobs"), *a[2:], **k),
          "gspo": losses.gspo_loss, "sapo": losses.sapo_loss, "vespo": losses.vespo_loss}[kind]
    ref, _ = fn(pad[0], pad[1], pad[3], pad[4], rollout_logprobs=pad[2], agg_mode=mode or DEFAULT_AGG[kind])
    torch.testing.assert_close(got, ref)
    (g_got,) = torch.autograd.grad(got, lp)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g_got, g_ref)
    assert int(parts[0].count) == (8 if (mode or DEFAULT_AGG[kind]) == "token-mean" else 2)


def test_mismatch_is_split_from_the_drift_of_older_tokens():
    """Tokens sampled by the weights the trainer holds measure the engine/trainer mismatch; older ones the
    policy's drift since: one large drift must not show as a mismatch (and the reverse)."""
    from megatron_bridge.batch import TrainSequence
    from megatron_bridge.policy_loss import mismatch

    engine = np.log(np.array([0.5, 0.5, 0.5, 0.5], np.float32))
    seq = TrainSequence(prompt_ids=[1, 2], gen_ids=[3, 4, 5, 6], rollout_logprobs=engine,
                        rollout_versions=np.array([1, 1, 2, 2]))
    old = [engine + np.array([0.3, -0.2, 1e-6, -2e-6], np.float32)]
    m = mismatch([seq], old, policy_version=2)
    assert (m["mismatch_tokens"], m["drift_tokens"]) == (2, 2)
    assert m["mismatch_abs_max"] == pytest.approx(2e-6, rel=0.1) and m["drift_abs_max"] == pytest.approx(0.3)
    assert m["drift_ops_mean"] == pytest.approx((np.expm1(0.3) + abs(np.expm1(-0.2))) / 2, rel=1e-5)
    whole = mismatch([seq], old, policy_version=None)  # no version known: every token is the trainer's own
    assert whole["mismatch_tokens"] == 4 and whole["drift_tokens"] == 0 and math.isnan(whole["drift_abs_max"])
    only_own = mismatch([seq], old, policy_version=1)
    assert only_own["mismatch_abs_max"] == pytest.approx(0.3) and only_own["drift_abs_max"] == pytest.approx(2e-6, rel=0.1)
    # a step that trains only older tokens: the mismatch figures are present, NaN over no token (null in the records)
    older = mismatch([seq], old, policy_version=3)
    assert older["mismatch_tokens"] == 0 and older["drift_tokens"] == 4
    assert all(math.isnan(older[f"mismatch_{k}"]) for k in ("abs_mean", "abs_max", "ops_mean"))
