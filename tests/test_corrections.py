"""The field's stale-token corrections against their published definitions: slime's masking of carried-over
tokens and IcePop, AReaL's decoupled PPO and M2PO, verl's sequence-level masked IS and geometric rejection
(`rollverify.losses.behaviour_correction`, wired through `megatron_bridge.policy_loss`), and SPEC-RL's cut of
carried responses (`rollverify.strategies.SpecCut`). Each is checked on hand-computed values and, where the
rule has a loop form, against a naive loop written from the source's text."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_bridge.batch import TrainSequence
from megatron_bridge.config import TrainerConfig
from megatron_bridge.policy_loss import offpolicy_mask, terms
from rollverify.losses import CORRECTIONS, CorrectionConfig, behaviour_correction, ppo_tis_loss
from rollverify.sections import ConfigError
from rollverify.strategies import AlgoConfig, SpecCut, first_false, make_strategy
from rollverify.types import Response

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def corr(method, **knobs):
    return CorrectionConfig(method=method, **knobs)


def with_ratios(r, kind, **knobs):
    """old = 0, rollout = -log r per token: the behaviour ratio r = exp(old - rollout) exactly."""
    r = t(r)
    old = torch.zeros_like(r)
    return behaviour_correction(corr(kind, **knobs), old, old - torch.log(r), torch.ones_like(r, dtype=torch.bool))


# --- token corrections --------------------------------------------------------------------------------------


def test_tis_is_the_truncated_weight_and_equals_the_default_loss():
    w, keep, _ = with_ratios([0.5, 1.0, 3.0], kind="tis", tis_cap=2.0)
    assert w.tolist() == pytest.approx([0.5, 1.0, 2.0]) and keep.all()
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, generator=g, dtype=F64)
    lp = old + 0.1 * torch.randn(6, generator=g, dtype=F64)
    rollout = old + 0.5 * torch.randn(6, generator=g, dtype=F64)
    adv, mask = torch.randn(6, generator=g, dtype=F64), torch.ones(6, dtype=torch.bool)
    w, _, _ = behaviour_correction(corr("tis", tis_cap=2.0), old, rollout, mask)
    a, _ = ppo_tis_loss(lp, old, rollout, adv, mask, tis_cap=2.0)
    b, _ = ppo_tis_loss(lp, old, None, adv, mask, behaviour_weight=w)
    torch.testing.assert_close(a, b)


def test_icepop_zeroes_weights_outside_the_band_and_keeps_the_loss_mask():
    # slime's icepop_function: w = r inside [tis_clip_low, tis_clip], else 0 (ends included)
    w, keep, m = with_ratios([0.4, 0.5, 1.3, 2.0, 2.1], kind="icepop", icepop_low=0.5, icepop_high=2.0)
    assert w.tolist() == pytest.approx([0.0, 0.5, 1.3, 2.0, 0.0])
    assert keep.all() and m["corr_zero_weight_frac"].item() == pytest.approx(0.4)
    assert m["corr_loss_masked_frac"].item() == 0.0


def test_decoupled_weight_is_the_proximal_over_behaviour_ratio_masked_above_the_cap():
    # AReaL: behave_imp_weight = exp(prox - behave), tokens above rejection_sampling.upper rejected (weight 0),
    # the normaliser unchanged; no truncation below the cap
    w, keep, _ = with_ratios([0.2, 1.0, 4.9, 5.0, 7.0], kind="decoupled", decoupled_cap=5.0)
    assert w.tolist() == pytest.approx([0.2, 1.0, 4.9, 5.0, 0.0]) and keep.all()


def test_decoupled_ppo_loss_by_hand():
    """AReaL's ppo_actor_loss_fn: max(-A r, -A clip(r)) with r = pi/pi_prox, times the behaviour weight, summed
    over the loss mask and divided by the count before rejection."""
    prox = t([-1.0, -1.0, -1.0])
    lp = (prox + t([math.log(1.5), 0.0, 0.0])).requires_grad_()
    behave = prox - t([0.0, math.log(2.0), math.log(6.0)])  # behaviour weights 1, 2, 6 (rejected)
    adv = t([1.0, -1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    w, _, _ = behaviour_correction(corr("decoupled", decoupled_cap=5.0), prox, behave, mask)
    loss, _ = ppo_tis_loss(lp, prox, None, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=math.inf,
                           behaviour_weight=w)
    assert loss.item() == pytest.approx((1.0 * -1.2 + 2.0 * 1.0 + 0.0) / 3)


def naive_m2po_keep(log_r):
    """AReaL's M2PO mask from its docs: mask the tokens with the largest second moment, one at a time, until
    the mean second moment of the rest is below the threshold (all but one when it never is)."""
    m2 = [x * x for x in log_r]
    order = sorted(range(len(m2)), key=lambda i: -m2[i])
    for k in range(len(m2)):
        rest = [m2[i] for i in order[k:]]
        if sum(rest) / len(rest) < 0.04:
            break
    else:
        k = len(m2) - 1
    keep = [True] * len(m2)
    for i in order[:k]:
        keep[i] = False
    return keep


def test_m2po_by_hand_and_against_the_naive_rule():
    # m2 = .25, .01, .0025, 0: the mean of all four is .0656 >= .04, without the largest .0042: one masked
    w, keep, m = with_ratios(np.exp([0.5, 0.1, -0.05, 0.0]).tolist(), kind="m2po", m2_threshold=0.04)
    assert keep.tolist() == [False, True, True, True]
    assert w.tolist() == pytest.approx([0.0, math.exp(0.1), math.exp(-0.05), 1.0])
    assert m["corr_loss_masked_frac"].item() == pytest.approx(0.25)
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        n = 1 + trial * 7
        log_r = (0.4 * torch.randn(n, generator=g, dtype=F64)).tolist()
        valid = torch.rand(n, generator=g) > 0.2
        old = torch.zeros(n, dtype=F64)
        _, keep, _ = behaviour_correction(corr("m2po", m2_threshold=0.04, decoupled_cap=1e9), old, old - t(log_r), valid)
        expect = naive_m2po_keep([x for x, v in zip(log_r, valid.tolist(), strict=True) if v])
        assert keep[valid].tolist() == expect
        assert not keep[~valid].any()


def test_m2po_keeps_one_token_when_no_count_reaches_the_threshold():
    w, keep, _ = with_ratios(np.exp([1.0, -0.9, 2.0]).tolist(), kind="m2po", m2_threshold=0.04)
    assert keep.tolist() == [False, True, False]  # the smallest second moment stays (AReaL: all but one)


# --- sequence corrections -----------------------------------------------------------------------------------


def test_seq_mis_sequence_weight_and_seq_sum_k1_rejection():
    """verl's decoupled_seq_is_rs: weight min(prod r, 2) on every token; a sequence stays where
    0.5 <= prod 1/r <= 2 (seq_sum_k1, '0.5_2.0')."""
    log_r = t([[0.1, 0.2, 0.0], [0.5, 0.5, 0.0], [-0.3, -0.3, -0.3]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    old = torch.zeros(3, 3, dtype=F64)
    w, keep, m = behaviour_correction(corr("seq_mis", seq_is_cap=2.0, seq_rs_low=0.5, seq_rs_high=2.0), old, old - log_r, mask)
    # row 0: sum 0.3 (the masked 0.0 ignored) -> w e^.3, kept; row 1: sum 1.0 -> prod 1/r = e^-1 < .5: rejected;
    # row 2: sum -0.9 -> prod 1/r = e^.9 = 2.46 > 2: rejected
    assert w[0, :2].tolist() == pytest.approx([math.exp(0.3)] * 2) and w[0, 2] == 0
    assert keep.tolist() == [[True, True, False], [False] * 3, [False] * 3]
    assert (w[1:] == 0).all()
    assert m["corr_loss_masked_frac"].item() == pytest.approx(6 / 8)
    # within the band the weight is truncated at the cap
    w, keep, _ = behaviour_correction(corr("seq_mis", seq_is_cap=1.5), old[:1], old[:1] - t([[0.3, 0.3, 0.0]]), torch.ones(1, 3, dtype=torch.bool))
    assert keep.all() and w[0].tolist() == pytest.approx([1.5] * 3)


def test_geo_rs_rejects_on_the_geometric_mean_ratio_and_weighs_nothing():
    log_r = t([[0.0005, 0.0005], [0.002, 0.002], [-0.0005, -0.0015]])
    old = torch.zeros(3, 2, dtype=F64)
    w, keep, _ = behaviour_correction(corr("geo_rs"), old, old - log_r, torch.ones(3, 2, dtype=torch.bool))
    # mean log r .0005 -> ratio 1/r = .9995 in [.999, 1.001]; .002 out; -.001 -> 1.001005 out
    assert keep.tolist() == [[True, True], [False, False], [False, False]]
    assert w.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


def test_correction_checks():
    x = torch.zeros(3, dtype=F64)
    mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="correction.method: one of none, tis, decoupled"):
        behaviour_correction(corr("nope"), x, x, mask)
    with pytest.raises(ValueError, match="weighs no token by the engine's log-probs"):
        behaviour_correction(corr("none"), x, x, mask)
    with pytest.raises(ValueError, match="weighs no token"):
        behaviour_correction(corr("mask_offpolicy"), x, x, mask)
    with pytest.raises(ValueError, match=r"seq_mis correction needs padded \[batch, tokens\]"):
        behaviour_correction(corr("seq_mis"), x, x, mask)
    with pytest.raises(ValueError, match=r"correction.icepop_low: must be <= correction.icepop_high \(2.0\)"):
        behaviour_correction(corr("icepop", icepop_low=3.0, icepop_high=2.0), x, x, mask)
    with pytest.raises(ValueError, match="correction.tis_cap: must be > 0.0, got -1"):
        behaviour_correction(corr("tis", tis_cap=-1.0), x, x, mask)
    with pytest.raises(ValueError, match="must share one shape"):
        behaviour_correction(corr("tis"), x, x[:2], mask)
    # garbage in masked positions never leaks
    w, keep, _ = behaviour_correction(corr("decoupled"), t([0.0, math.nan]), t([0.0, math.inf]),
                                      torch.tensor([True, False]))
    assert w.tolist() == [1.0, 0.0] and keep.tolist() == [True, False]
    # mask_offpolicy weighs its kept tokens with `then`, by the same definition
    w, keep, _ = behaviour_correction(corr("mask_offpolicy", then="icepop"), x, x - t([0.0, 1.0, -0.1]), mask)
    assert w.tolist() == pytest.approx([1.0, 0.0, math.exp(-0.1)]) and keep.all()


# --- through the trainer's loss terms -----------------------------------------------------------------------


def case(n_counts=(3, 4)):
    g = torch.Generator().manual_seed(5)
    n = sum(n_counts)
    old = -torch.rand(n, generator=g, dtype=F64)
    lp = (old + 0.05 * torch.randn(n, generator=g, dtype=F64)).requires_grad_()
    rollout = old + t([0.0, 0.0, 0.0, 2.0, 0.0, 0.0, -1.0])  # one token of behaviour weight e^-2, one e
    adv = torch.repeat_interleave(t([1.0, -1.0]), torch.tensor(list(n_counts)))
    return lp, old, rollout, adv, torch.ones(n, dtype=torch.bool), list(n_counts)


@pytest.mark.parametrize("kind", ["decoupled", "icepop", "m2po", "seq_mis", "geo_rs"])
def test_trainer_terms_apply_the_correction_and_its_normaliser(kind):
    lp, old, rollout, adv, mask, counts = case()
    cfg = TrainerConfig(correction=corr(kind, m2_threshold=0.5))
    got = terms(lp, old, rollout, adv, mask, counts, cfg)
    assert "corr_weight_mean_sum" in got.stats
    # the loss masks of m2po (the e^-2 token: m2 = 4, the rest's mean 1/6 < .5), seq_mis (the second sequence:
    # prod 1/r = e > 2) and geo_rs (the second sequence's geometric mean leaves [.999, 1.001]) shrink the
    # count; decoupled and icepop keep it (the second sequence's weights differ from TIS's: e uncapped, 0 / 0)
    expect = {"decoupled": 7, "icepop": 7, "m2po": 6, "seq_mis": 3, "geo_rs": 3}[kind]
    assert int(got.count) == expect
    base = terms(lp, old, rollout, adv, mask, counts, TrainerConfig())
    assert not torch.equal(got.loss_sum.detach(), base.loss_sum.detach())


def test_config_rules_of_the_correction_section():
    with pytest.raises(ConfigError, match=r"trainer.correction.icepop_low: must be <= trainer.correction.icepop_high"):
        TrainerConfig(correction=corr("icepop", icepop_low=3.0)).check()
    with pytest.raises(ConfigError, match="trainer.correction.then: weighs the tokens slime's mask keeps, so it needs "
                                          "trainer.correction.method=mask_offpolicy"):
        TrainerConfig(correction=corr("icepop", then="tis")).check()
    with pytest.raises(ConfigError, match="trainer.correction.seq_rs_low: must be > 0.0"):
        TrainerConfig(correction=corr("seq_mis", seq_rs_low=0.0)).check()
    TrainerConfig(correction=corr("mask_offpolicy", then="seq_mis")).check()


def test_the_setting_resolves_to_a_weight_a_mask_and_whether_it_reads_the_engines_log_probs():
    """The one setting against the three keys it replaces (use_tis, stale_correction, mask_offpolicy), on every
    combination those accepted: (weight the loss takes, slime's mask, engine log-probs read)."""
    expect = {"none": (None, False, False), "tis": ("tis", False, True), "mask_offpolicy": (None, True, False)}
    expect |= {k: (k, False, True) for k in ("decoupled", "icepop", "m2po", "seq_mis", "geo_rs")}
    assert set(expect) == set(CORRECTIONS)
    for method, (weight, masks, reads) in expect.items():
        c = corr(method)
        assert (c.weighting, c.masks_offpolicy, c.reads_rollout_logprobs) == (weight, masks, reads), method
    for then in ("tis", "decoupled", "icepop", "m2po", "seq_mis", "geo_rs"):
        c = corr("mask_offpolicy", then=then)
        assert (c.weighting, c.masks_offpolicy, c.reads_rollout_logprobs) == (then, True, True)


def old_keys_terms(lp, old, rollout, adv, mask, counts, use_tis, stale, knobs):
    """The loss terms as the three old keys computed them (no correction when use_tis is off, else TIS inside the
    loss, else the named correction's weight and mask in place of TIS), from the core functions."""
    from megatron_bridge.policy_loss import _padded

    if not use_tis:
        return ppo_tis_loss(lp, old, None, adv, mask, global_count=1)[0], int(mask.sum())
    if stale == "tis":
        return ppo_tis_loss(lp, old, rollout, adv, mask, tis_cap=knobs.tis_cap, global_count=1)[0], int(mask.sum())
    if stale in ("seq_mis", "geo_rs"):
        lp, old, rollout, adv, mask = (_padded(x, counts) for x in (lp, old, rollout, adv, mask))
    w, keep, _ = behaviour_correction(CorrectionConfig(method=stale, **{
        k: getattr(knobs, k) for k in ("decoupled_cap", "icepop_low", "icepop_high", "m2_threshold", "seq_is_cap",
                                       "seq_rs_low", "seq_rs_high", "geo_rs_low", "geo_rs_high")}), old, rollout, mask)
    keep = mask.bool() & keep
    return ppo_tis_loss(lp, old, rollout, adv, keep, global_count=1, behaviour_weight=w)[0], int(keep.sum())


LEGACY = [(False, "tis", False), (True, "tis", False), *((True, k, False) for k in
          ("decoupled", "icepop", "m2po", "seq_mis", "geo_rs")), (False, "tis", True), (True, "tis", True),
          *((True, k, True) for k in ("decoupled", "icepop", "m2po", "seq_mis", "geo_rs"))]


@pytest.mark.parametrize("use_tis,stale,mask_offpolicy", LEGACY)
def test_every_old_combination_keeps_its_loss(use_tis, stale, mask_offpolicy):
    """(use_tis, stale_correction, mask_offpolicy), each combination the old keys accepted, against the method
    that replaces it: the same loss, gradient and normaliser (tokens the mask drops are out of `mask` already,
    as `loss_inputs` hands them to the loss)."""
    weight = stale if use_tis else "none"
    c = corr("mask_offpolicy", then=weight) if mask_offpolicy else corr(weight)
    c.m2_threshold, c.tis_cap = 0.5, 1.5
    lp, old, rollout, adv, mask, counts = case()
    if mask_offpolicy:
        mask = mask & t([1, 1, 0, 1, 1, 1, 0]).bool()  # two carried-over tokens
    got = terms(lp, old, rollout, adv, mask, counts, TrainerConfig(correction=c))
    (g_got,) = torch.autograd.grad(got.loss_sum, lp)
    ref, count = old_keys_terms(lp, old, rollout, adv, mask, counts, use_tis, stale, c)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(got.loss_sum, ref.to(got.loss_sum.dtype))
    torch.testing.assert_close(g_got, g_ref)
    assert int(got.count) == count
    assert ("tis_weight_mean_sum" in got.stats) == (use_tis and stale == "tis")
    assert ("corr_weight_mean_sum" in got.stats) == (use_tis and stale != "tis")


def test_slime_offpolicy_mask_drops_tokens_of_older_versions():
    s = TrainSequence(prompt_ids=[1, 2], gen_ids=[5, 6, 7, 8], rollout_versions=[2, 3, 4, 4])
    assert offpolicy_mask(s, 4).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert offpolicy_mask(s, 2).tolist() == [1.0] * 4
    assert offpolicy_mask(TrainSequence(prompt_ids=[1], gen_ids=[5, 6]), 9).tolist() == [1.0, 1.0]


def test_offpolicy_mask_composes_with_the_sequence_loss_mask():
    from megatron_bridge.batch import MicroBatch
    from megatron_bridge.policy_loss import loss_inputs

    seqs = [TrainSequence(prompt_ids=[1], gen_ids=[5, 6, 7], rollout_versions=[1, 2, 2], loss_mask=[1, 1, 0],
                          advantage=1.0, rollout_logprobs=[-1.0, -1.0, -1.0]),
            TrainSequence(prompt_ids=[1], gen_ids=[5, 6], rollout_versions=[1, 1], advantage=-1.0,
                          rollout_logprobs=[-1.0, -1.0])]
    mb = MicroBatch.__new__(MicroBatch)
    mb.seq_index = [0, 1]
    old = [np.zeros(3, np.float32), np.zeros(2, np.float32)]
    x = loss_inputs(seqs, mb, old, rollout_logprobs=True, mask_older_than=2)
    assert x["mask"].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert loss_inputs(seqs, mb, old, rollout_logprobs=True)["mask"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert loss_inputs(seqs, mb, old, rollout_logprobs=False)["rollout"] is None


# --- SPEC-RL ------------------------------------------------------------------------------------------------


def response(index, n, version=0):
    r = Response(group_id=0, index=index, prompt_ids=[1, 2], max_new_tokens=4096)
    if n:
        r.append(np.arange(n), np.full(n, -1.0), np.full(n, version))
    return r


def test_first_false_against_a_loop():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 5, 3, 8, 0, 2])
    flags = torch.rand(int(lengths.sum()), generator=g) > 0.3
    got, start = first_false(flags, lengths).tolist(), 0
    for i, n in enumerate(lengths.tolist()):
        row = flags[start:start + n].tolist()
        assert got[i] == (row.index(False) if False in row else n)
        start += n


def test_spec_rl_accepts_where_the_new_policy_is_at_least_as_likely_and_cuts_at_the_first_rejection():
    rs = [response(0, 4), response(1, 3), response(2, 2), response(3, 0)]
    new = [np.array([-1.0, -0.5, -1.0, -1.0]),  # delta >= 0 everywhere: kept whole
           np.array([-1.0, -np.inf, -1.0]),  # p_new = 0 at token 1: never accepted
           np.array([-1.0, np.nan])]  # a non-finite delta is a rejection
    out = SpecCut(seed=0).apply(rs, [*new, np.zeros(0)], policy_version=3)
    assert out.keep_lengths.tolist() == [4, 1, 1, 0]
    assert out.stats["spec_rejected_tokens"] == 2.0


def test_spec_rl_acceptance_probability_is_the_likelihood_ratio():
    # one-token responses with p_new / p_old = 0.3: kept with probability 0.3 (4 sigma ~ 0.013 at n = 20000)
    n = 20000
    rs = [response(i, 1) for i in range(n)]
    new = [np.array([-1.0 + math.log(0.3)])] * n
    kept = SpecCut(seed=1).apply(rs, new, policy_version=1).keep_lengths
    assert abs(kept.mean() - 0.3) < 0.013
    # lenience: SPEC-RL's bias shifts delta up; a lenience of -log 0.3 accepts every token
    kept = SpecCut(lenience=-math.log(0.3) + 1e-9, seed=1).apply(rs[:200], new[:200], policy_version=1).keep_lengths
    assert kept.tolist() == [1] * 200
    # scale > 1 is stricter: probability 0.3^2
    kept = SpecCut(scale=2.0, seed=1).apply(rs, new, policy_version=1).keep_lengths
    assert abs(kept.mean() - 0.09) < 0.009


def test_spec_rl_cut_equals_the_naive_rule_on_the_same_draws():
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 9, 4, 7]
    rs = [response(i, n) for i, n in enumerate(lengths)]
    new = [(-1.0 + 0.4 * torch.randn(n, generator=g, dtype=F64)).numpy() for n in lengths]
    strategy = SpecCut(seed=11)
    got = strategy.apply(rs, new, policy_version=6).keep_lengths.tolist()
    draws = torch.Generator(device="cpu").manual_seed(11 * 1_000_003 + 6)
    u = torch.rand(sum(lengths), generator=draws, dtype=torch.float64).clamp_min(1e-12).tolist()
    pos = 0
    for i, n in enumerate(lengths):
        keep = n
        for j in range(n):
            delta = float(np.float64(new[i][j]) - np.float64(np.float32(-1.0)))
            if not (delta >= 0 or math.log(u[pos + j]) <= delta):
                keep = j
                break
        assert got[i] == keep
        pos += n
    # reproducible for a (seed, version), different draws for another version
    assert strategy.apply(rs, new, policy_version=6).keep_lengths.tolist() == got
    others = [SpecCut(seed=11).apply(rs, new, policy_version=v).keep_lengths.tolist() for v in range(7, 12)]
    assert any(o != got for o in others)


def test_spec_rl_p_min_and_config():
    rs = [response(0, 3)]
    new = [np.array([-0.5, -0.5, -2.0])]  # delta >= 0 on the first two, p_new = e^-2 = 0.135 < 0.2 at the third
    assert SpecCut(p_min=0.2, seed=0).apply(rs, new, policy_version=1).keep_lengths.tolist() == [2]
    cfg = AlgoConfig(mode="spec_rl", spec_lenience=0.5, spec_scale=2.0, spec_p_min=0.1, spec_seed=7)
    s = make_strategy(cfg=cfg)
    assert isinstance(s, SpecCut) and (s.lenience, s.scale, s.p_min, s.seed) == (0.5, 2.0, 0.1, 7)
    assert s.needs_new_logprobs and s.carries_over
    for key, value in (("spec_lenience", -1.0), ("spec_scale", 0.0), ("spec_p_min", 2.0), ("spec_seed", 1.5)):
        with pytest.raises(ValueError, match=f"algo.{key} must be"):
            AlgoConfig(mode="spec_rl", **{key: value})


# --- on the real trainer ------------------------------------------------------------------------------------


@pytest.mark.megatron
@pytest.mark.filterwarnings("ignore::UserWarning:megatron.*", "ignore::DeprecationWarning:megatron.*",
                            "ignore::FutureWarning:megatron.*", "ignore::FutureWarning:torch.distributed.*")
def test_corrections_and_the_offpolicy_mask_on_the_megatron_trainer():
    """A real Megatron-Core step: slime's mask takes the older tokens out of the loss (its token count), a
    correction's loss equals the core function's on the whole batch, and a batch of only carried tokens under
    the mask steps with a zero gradient."""
    from megatron_fixtures import fixed_sequences, hf_token_logprobs, tiny_path

    from megatron_bridge.policy_loss import _padded
    from megatron_bridge.trainer import MegatronTrainer

    seqs = fixed_sequences(4)
    lps, _ = hf_token_logprobs(tiny_path(), seqs)
    for i, s in enumerate(seqs):
        s.rollout_logprobs = lps[i] - 0.3 * (i % 2)  # behaviour weights e^.3 on two sequences
        s.advantage = [1.0, -1.0, 0.5, -0.5][i]
        g = s.gen_ids.size
        s.rollout_versions = np.where(np.arange(g) < g // 2, 4, 5)  # first half carried over from version 4
    trainer = MegatronTrainer(tiny_path(), TrainerConfig(micro_batch_tokens=24, lr=1e-2, correction=corr(
        "mask_offpolicy", then="seq_mis", seq_rs_low=0.2)))
    old, _ = trainer.compute_logprobs(seqs)
    counts = [s.gen_ids.size for s in seqs]
    own = sum(int((s.rollout_versions == 5).sum()) for s in seqs)
    m = trainer.train_step(seqs, policy_version=5)
    assert m["tokens"] == own and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    # the loss of the step's first forward (weights before the step) is the core's on the masked batch
    t_ = lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.float32))  # noqa: E731
    lp = t_([old])
    mask = t_([(s.rollout_versions == 5).astype(np.float32) for s in seqs])
    adv = t_([np.full(s.gen_ids.size, s.advantage, np.float32) for s in seqs])
    pad = [_padded(x, counts) for x in (lp, lp, t_([s.rollout_logprobs for s in seqs]), adv, mask)]
    w, keep, _ = behaviour_correction(corr("seq_mis", seq_rs_low=0.2), pad[1], pad[2], pad[4].bool())
    ref, _ = ppo_tis_loss(pad[0], pad[1], None, pad[3], pad[4].bool() & keep, behaviour_weight=w)
    # own tokens e^.3 each: 5 of them give prod 1/r = e^-1.5 = .22 (kept), 6 give e^-1.8 = .17 < .2 (rejected)
    assert int((pad[4].bool() & keep).sum()) == own - 6
    assert m["loss"] == pytest.approx(float(ref), abs=1e-5)
    # only carried tokens: nothing to learn from under slime's mask
    m = trainer.train_step(seqs, policy_version=9)
    assert m["tokens"] == 0 and m["grad_norm"] == 0
    with pytest.raises(ValueError, match="mask_offpolicy needs the policy_version"):
        trainer.train_step(seqs)
    trainer.close()
