"""Advantages and losses against hand-computed values, finite-difference gradients, dtype stability."""

from __future__ import annotations

import math

import pytest
import torch

from rollverify.losses import (
    entropy_from_logits,
    expand_to_tokens,
    grpo_advantages,
    gspo_loss,
    masked_mean,
    ppo_tis_loss,
    sapo_loss,
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


def test_expand_and_masked_mean():
    assert expand_to_tokens(t([1.0, 2.0, 3.0]), torch.tensor([2, 0, 1])).tolist() == [1.0, 1.0, 3.0]
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
    loss, _ = ppo_tis_loss(lp, old, rollout, adv, mask, num_valid_tokens=10)
    assert loss.item() == pytest.approx((-2.0 - 2.6 + 0.8 + 1.5) / 10)
    no_dual, _ = ppo_tis_loss(lp, old, rollout, adv, mask, dual_clip_c=math.inf)
    assert no_dual.item() == pytest.approx((-2.0 - 2.6 + 0.8 + 0.5 * 4.0) / 4)
    no_tis, m = ppo_tis_loss(lp, old, None, adv, mask)
    assert no_tis.item() == pytest.approx((-2.0 - 1.3 + 0.8 + 3.0) / 4) and "tis_weight_mean" not in m
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_tis_loss(lp, old, rollout, adv, mask, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="global valid count must be >= 1"):
        ppo_tis_loss(lp, old, rollout, adv, mask, num_valid_tokens=0)
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
                          num_valid_tokens=n)[0] for i in range(2)]
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
        "gspo": lambda x: gspo_loss(x, old, adv, mask, eps_low=0.05, eps_high=0.05, rollout_logprobs=rollout)[0],
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
    for f in (gspo_loss, sapo_loss):
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
    loss, _ = gspo_loss(old.clone(), old, t([1.0, 3.0]), mask, num_valid_seqs=4)
    assert loss.item() == pytest.approx((-1.0 - 3.0) / 4)
    with pytest.raises(ValueError, match=r"gspo_loss needs padded \[batch, tokens\]"):
        gspo_loss(old[0], old[0], t([1.0, 1.0]), mask[0])


def test_sapo_hand_values():
    old = t([-1.0, -1.0, -1.0])
    lp = old.clone().requires_grad_()  # r = 1: f(1) = 4/tau * sigmoid(0) = 2/tau
    adv = t([1.0, -1.0, 0.5])
    loss, m = sapo_loss(lp, old, adv, torch.tensor([True, True, False]), tau_pos=1.0, tau_neg=2.0)
    assert loss.item() == pytest.approx((-1.0 * 2 / 1.0 + 1.0 * 2 / 2.0) / 2)
    loss.backward()
    # On-policy the gate's slope is 1: the plain policy-gradient -A r / count.
    assert lp.grad.tolist() == pytest.approx([-0.5, 0.5, 0.0])
    assert m["gate_grad_weight_mean"].item() == pytest.approx(1.0)


def test_sapo_gate_attenuates_far_off_policy_tokens():
    old = t([-1.0, -1.0])
    lp = (old + t([0.0, math.log(5.0)])).requires_grad_()
    loss, _ = sapo_loss(lp, old, t([1.0, 1.0]), torch.tensor([True, True]))
    loss.backward()
    near, far = lp.grad.abs().tolist()
    # far: -A * 4 p (1 - p) * r / 2 with p = sigmoid(4): much smaller than the on-policy -A / 2
    p = 1 / (1 + math.exp(-4.0))
    assert far == pytest.approx(4 * p * (1 - p) * 5.0 / 2) and far < near


# --- entropy ----------------------------------------------------------------------------------------------


def test_entropy_from_logits():
    h = entropy_from_logits(torch.zeros(2, 4))
    torch.testing.assert_close(h, torch.full((2,), math.log(4)))
    masked = entropy_from_logits(torch.tensor([[0.0, -math.inf, 0.0]]))
    torch.testing.assert_close(masked, torch.tensor([math.log(2)]))
    peaked = entropy_from_logits(torch.tensor([[1000.0, 0.0]], dtype=torch.bfloat16))
    assert peaked.dtype == torch.float32 and peaked.item() == pytest.approx(0.0, abs=1e-6)
