"""Every strategy on hand-computed cases; conditional switching (window and EMA); config validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rollverify.strategies import (
    AlgoConfig,
    ConditionalSwitch,
    OnPolicy,
    OpsFilter,
    Partial,
    RollVerify,
    StalenessFilter,
    Switching,
    make_strategy,
)
from rollverify.types import Response

INF = math.inf


def response(index, versions, finished=False):
    r = Response(group_id=0, index=index, prompt_ids=[1, 2], max_new_tokens=16)
    if versions:
        r.append(np.arange(len(versions)), np.full(len(versions), -1.0), versions)
    r.finished = finished
    return r


def new_logprobs(responses, ops):
    """New log-probs with token OPS D = ops exactly enough: new = old + log1p(D)."""
    return [r.logprobs + np.log1p(np.asarray(d, np.float64)).astype(np.float32) for r, d in zip(responses, ops, strict=True)]


def carried():
    """A: v[1,1,2,2] D[0,0,.5,.5]; B: v[2,2,2] D[0,3,0]; C: v[0] D[0]; E: empty."""
    rs = [response(0, [1, 1, 2, 2]), response(1, [2, 2, 2], finished=True), response(2, [0]), response(3, [])]
    return rs, new_logprobs(rs, [[0, 0, 0.5, 0.5], [0, 3, 0], [0], []])


def test_partial_keeps_everything():
    rs, new = carried()
    out = Partial().apply(rs, new, policy_version=3)
    assert out.keep_lengths.tolist() == [4, 3, 1, 0]
    assert out.stats["acceptance_rate"] == 1.0 and out.stats["kept_whole_rate"] == 1.0
    assert out.stats["staleness_max"] == 3.0 and out.stats["staleness_mean"] == pytest.approx((2 + 1 + 3) / 3)
    assert not Partial.needs_new_logprobs and Partial.carries_over


def test_on_policy_restarts_anything_handed_in():
    rs, new = carried()
    out = OnPolicy().apply(rs, None, policy_version=3)
    assert out.keep_lengths.tolist() == [0, 0, 0, 0]
    assert out.stats["restarted"] == 3.0  # the empty response had nothing to lose
    assert not OnPolicy.carries_over


def test_staleness_filter():
    rs, _ = carried()
    # staleness at version 3: A 3-1=2, B 1, C 3, E 0 (empty). S=2 restarts C only; S=1 also A.
    assert StalenessFilter(2).apply(rs, None, 3).keep_lengths.tolist() == [4, 3, 0, 0]
    out = StalenessFilter(1).apply(rs, None, 3)
    assert out.keep_lengths.tolist() == [0, 3, 0, 0]
    assert out.stats["acceptance_rate"] == pytest.approx(3 / 8) and out.stats["restarted"] == 2.0


def test_ops_filter_uses_whole_response_mean():
    rs, new = carried()
    # mean D: A 0.25, B 1.0, C 0.
    out = OpsFilter(0.3).apply(rs, new, 3)
    assert out.keep_lengths.tolist() == [4, 0, 1, 0]
    assert OpsFilter(0.2).apply(rs, new, 3).keep_lengths.tolist() == [0, 0, 1, 0]
    assert out.stats["ops_response_mean"] == pytest.approx((0.25 + 1.0 + 0.0) / 3, rel=1e-5)


def test_rollverify_two_stages_and_switches_for_each_stage():
    rs, new = carried()
    # Sequence stage (d_s 0.1): A's v2 segment mean 0.5 -> keep 2; B's only segment mean 1 -> keep 0.
    out = RollVerify(0.1, INF).apply(rs, new, 3)
    assert out.keep_lengths.tolist() == [2, 0, 1, 0]
    assert out.stats["cut_by_seq_stage"] == 2.0 and out.stats["cut_by_token_stage"] == 0.0
    # Token stage (d_t 2): only B's token 1 (D = 3) -> keep 1.
    out = RollVerify(INF, 2.0).apply(rs, new, 3)
    assert out.keep_lengths.tolist() == [4, 1, 1, 0]
    assert out.stats["acceptance_rate"] == pytest.approx(6 / 8)
    assert out.stats["kept_whole_rate"] == pytest.approx(2 / 3) and out.stats["truncated"] == 1.0
    # Both, through the factory and its stage switches.
    cfg = AlgoConfig(d_s=0.1, d_t=2.0, conditional_switch=False)
    assert make_strategy("rollverify", cfg).apply(rs, new, 3).keep_lengths.tolist() == [2, 0, 1, 0]
    no_seq = AlgoConfig(d_s=0.1, d_t=2.0, seq_stage=False, conditional_switch=False)
    assert make_strategy("rollverify", no_seq).apply(rs, new, 3).keep_lengths.tolist() == [4, 1, 1, 0]
    neither = AlgoConfig(seq_stage=False, token_stage=False, conditional_switch=False)
    assert make_strategy("rollverify", neither).apply(rs, new, 3).keep_lengths.tolist() == [4, 3, 1, 0]


def test_packed_new_logprobs_are_accepted():
    rs, new = carried()
    packed = torch.from_numpy(np.concatenate(new))
    assert RollVerify(0.1, INF).apply(rs, packed, 3).keep_lengths.tolist() == [2, 0, 1, 0]


def test_outcome_decisions_and_counts():
    rs, new = carried()
    out = RollVerify(0.1, INF).apply(rs, new, 3)
    assert out.decisions == {"0-0": 2, "0-1": 0, "0-2": 1, "0-3": 0}
    assert out.stats["restarted"] == 1.0 and out.stats["truncated"] == 1.0


def test_token_ops_are_computed_once_and_feed_both_the_cut_and_ops_mean(monkeypatch):
    import rollverify.strategies as strategies

    calls = []
    real = strategies.token_ops
    monkeypatch.setattr(strategies, "token_ops", lambda old, new, out=None: calls.append(old.numel()) or real(old, new))
    rs, new = carried()
    out = RollVerify(0.1, 2.0).apply(rs, new, 3)
    assert calls == [8] and out.keep_lengths.tolist() == [2, 0, 1, 0]
    assert out.stats["ops_mean"] == pytest.approx((0.5 + 0.5 + 3) / 8, rel=1e-5)
    # a strategy that decides without OPS reports it when given new log-probs (monitoring), not otherwise
    assert Partial().apply(rs, new, 3).stats["ops_mean"] == pytest.approx(4 / 8, rel=1e-5)
    assert "ops_mean" not in Partial().apply(rs, None, 3).stats and calls == [8, 8]
    new[1][1] = -np.inf  # the new policy forbids B's token 1: D = inf, left out of the mean
    out = OpsFilter(0.3).apply(rs, new, 3)
    assert out.stats["ops_mean"] == pytest.approx(1 / 7, rel=1e-5) and out.stats["ops_nonfinite_responses"] == 1.0


def test_new_logprobs_checks():
    rs, new = carried()
    with pytest.raises(ValueError, match="new_logprobs are required"):
        RollVerify().apply(rs, None, 3)
    with pytest.raises(ValueError, match="one array per response"):
        RollVerify().apply(rs, new[:2], 3)
    with pytest.raises(ValueError, match=r"new_logprobs\[1\] \(0-1\) must have one value per generated token"):
        RollVerify().apply(rs, [new[0], new[1][:2], new[2], new[3]], 3)
    with pytest.raises(ValueError, match=r"packed new_logprobs must be \[N=8\]"):
        RollVerify().apply(rs, torch.zeros(7), 3)


def test_nothing_to_verify_gives_every_statistic_counts_zero_and_rates_nan():
    """rollverify.metrics' rule: a figure with nothing to measure is present, a count 0 and a rate NaN (null)."""
    for mode in ("partial", "rollverify", "spec_rl"):
        out = make_strategy(mode).apply([], [], 1)
        assert out.keep_lengths.tolist() == [] and math.isnan(out.stats["acceptance_rate"])
        assert out.stats["verified_tokens"] == 0.0 and out.stats["env_tokens"] == 0.0
        assert math.isnan(out.stats["staleness_max"]) and math.isnan(out.stats["ops_mean"])
    assert make_strategy("rollverify").apply([], [], 1).stats["segments"] == 0.0


# --- conditional switching --------------------------------------------------------------------------------


def test_window_switch_waits_for_a_full_window():
    s = ConditionalSwitch(window=2, tau=0.5)
    assert not s.update(0.1)  # window not full yet, however low
    assert not s.update(0.9)  # mean 0.5 is not < 0.5
    assert s.update(0.0)  # mean(0.9, 0.0) = 0.45 < 0.5
    assert s.switched and "0.4500 < tau 0.5" in s.reason and "window" in s.reason
    assert not s.update(0.0)  # fires once


def test_ema_switch():
    s = ConditionalSwitch(window=2, tau=0.5, estimator="ema", ema_alpha=0.5)
    assert not s.update(1.0)  # ema 1.0
    assert not s.update(0.0)  # ema 0.5, not < 0.5
    assert s.estimate == 0.5
    assert s.update(0.0)  # ema 0.25
    assert s.estimate == 0.25 and "ema" in s.reason


def test_switch_state_round_trip_and_checks():
    s = ConditionalSwitch(window=3, tau=0.5)
    s.update(0.4)
    s.update(0.2)
    t = ConditionalSwitch.from_state(s.to_state())
    assert t.update(0.3) and t.history == [0.4, 0.2, 0.3]
    with pytest.raises(ValueError, match=r"acceptance_rate must be in \[0, 1\]"):
        s.update(1.5)
    with pytest.raises(ValueError, match="estimator must be one of"):
        ConditionalSwitch(estimator="median")


def test_switching_strategy_goes_on_policy_after_low_acceptance():
    rs, new = carried()
    cfg = AlgoConfig(d_s=0.1, d_t=2.0, switch_window=2, switch_tau=0.5)
    strategy = make_strategy("rollverify", cfg)
    assert isinstance(strategy, Switching) and strategy.mode == "rollverify" and strategy.carries_over
    first = strategy.apply(rs, new, 3)  # acceptance 3/8
    assert not first.switched and first.stats["switched"] == 0.0
    assert strategy.apply([], [], 4).stats["switch_estimate"] == pytest.approx(3 / 8)  # nothing verified: no update
    second = strategy.apply(rs, new, 4)
    assert second.switched and "window" in second.switch_reason
    assert second.keep_lengths.tolist() == [2, 0, 1, 0]  # the switching step's verification still applies
    assert strategy.mode == "on_policy" and not strategy.carries_over
    assert strategy.apply(rs, new, 5).keep_lengths.tolist() == [0, 0, 0, 0]
    # A checkpoint restores the switched state.
    fresh = make_strategy("rollverify", cfg)
    fresh.load_state(json.loads(json.dumps(strategy.to_state())))
    assert fresh.mode == "on_policy" and fresh.switch.reason == strategy.switch.reason
    assert Partial().to_state() == {}


def test_make_strategy_modes():
    cfg = AlgoConfig(staleness_s=2, ops_gamma=0.3)
    assert isinstance(make_strategy("on_policy", cfg), OnPolicy)
    assert isinstance(make_strategy("partial", cfg), Partial)
    assert make_strategy("staleness_filter", cfg).staleness_s == 2
    assert make_strategy("ops_filter", cfg).ops_gamma == 0.3
    assert isinstance(make_strategy(cfg=AlgoConfig(mode="partial")), Partial)
    with pytest.raises(ValueError, match="mode must be one of"):
        make_strategy("fast")


# --- config -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("mode", "async", "algo.mode must be one of"),
        ("d_s", -0.01, "algo.d_s must be a number >= 0"),
        ("d_t", "2", "algo.d_t must be a number >= 0"),
        ("ops_gamma", float("nan"), "algo.ops_gamma must be a number >= 0"),
        ("seq_stage", 1, "algo.seq_stage must be true or false"),
        ("staleness_s", -1, "algo.staleness_s must be an integer >= 0"),
        ("switch_window", 0, "algo.switch_window must be an integer >= 1"),
        ("switch_tau", 1.5, r"algo.switch_tau must be a number in \[0, 1\]"),
        ("switch_estimator", "median", "algo.switch_estimator must be one of"),
        ("ema_alpha", 0.0, r"algo.ema_alpha must be a number in \(0, 1\]"),
    ],
)
def test_config_validation_names_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        AlgoConfig(**{key: value})


def test_the_module_doc_lists_every_mode():
    import rollverify.strategies as strategies

    listed = [line.split()[0] for line in strategies.__doc__.splitlines()[2:] if line.startswith("  ") and
              line.split() and not line.startswith("   ")]
    assert listed == list(strategies.MODES)



def test_every_threshold_default_is_the_papers_one_constant():
    import inspect

    from rollverify.verify import D_S, D_T, two_stage_verify, two_stage_verify_ops

    assert (AlgoConfig().d_s, AlgoConfig().d_t) == (D_S, D_T) == (0.01, 2.0)
    for fn in (RollVerify.__init__, two_stage_verify, two_stage_verify_ops):
        params = inspect.signature(fn).parameters
        assert (params["d_s"].default, params["d_t"].default) == (D_S, D_T), fn
