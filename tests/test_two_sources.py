"""Responses of policy and environment tokens: every per-token field is cut together, verification
reads policy tokens only, a cut removes the environment tokens after it, and a checkpoint keeps the source."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollverify.buffer import RolloutBuffer
from rollverify.strategies import AlgoConfig, RollVerify, make_strategy
from rollverify.types import ENV_VERSION, ENVIRONMENT, POLICY, Group, Response, VerifyBatch
from rollverify.verify_reference import reference_verify_sources


def tool_response(routes: bool = False) -> Response:
    """5 policy tokens (a call, version 0), 4 environment tokens (its output), 3 policy tokens (version 1)."""
    r = Response(0, 0, np.array([7, 8]), max_new_tokens=32)
    rt = (lambda n: np.zeros((n, 2, 1), np.int32)) if routes else (lambda n: None)
    r.append([10, 11, 12, 13, 14], np.full(5, -0.5), 0, rt(5), finished=False)
    r.append_environment([20, 21, 22, 23])
    r.append([30, 31, 32], np.full(3, -0.25), 1, rt(3), finished=False)
    return r


def test_environment_tokens_carry_no_logprob_or_version_and_are_cut_with_the_rest():
    r = tool_response(routes=True)
    assert r.sources.tolist() == [0] * 5 + [1] * 4 + [0] * 3
    assert np.isnan(r.logprobs[5:9]).all() and (r.versions[5:9] == ENV_VERSION).all()
    assert (r.routed_experts[5:9] == -1).all()  # unknown until the engine prefills them
    assert (r.num_policy_tokens, r.num_env_tokens, r.num_env_runs) == (8, 4, 1)
    assert r.staleness(3) == 3  # the oldest *policy* token, not ENV_VERSION
    assert not r.finished
    cut = r.truncate(7)  # inside the output: every field together
    assert cut == 5 and r.num_tokens == 7
    assert all(len(getattr(r, k)) == 7 for k in ("token_ids", "logprobs", "versions", "sources", "routed_experts"))
    assert r.sources.tolist() == [0] * 5 + [1] * 2
    with pytest.raises(ValueError, match="one logprob and one version per token.*sources"):
        r.append([1, 2], [0.0, 0.0], 1, np.zeros((2, 2, 1)), sources=[0])
    with pytest.raises(ValueError, match="sources must be"):
        Response(0, 0, [1], 4, token_ids=[1], logprobs=[0.0], versions=[0], sources=[2])


def test_verify_batch_holds_policy_tokens_and_maps_keep_lengths_back():
    r, plain = tool_response(), Response(0, 1, np.array([7]), 8, token_ids=[1, 2], logprobs=[-1, -1], versions=[0, 0])
    b = VerifyBatch.from_responses([r, plain])
    assert b.lengths.tolist() == [8, 2] and b.full_lengths.tolist() == [12, 2] and b.num_tokens == 10
    assert not torch.isnan(b.logprobs).any() and (b.versions >= 0).all()
    # a cut at policy token k -> the whole-response position of that token; all kept -> the whole response
    keep = b.full_keep(torch.tensor([0, 1]))
    assert keep.tolist() == [0, 1]
    assert b.full_keep(torch.tensor([4, 2])).tolist() == [4, 2]  # inside the call: its output goes too
    assert b.full_keep(torch.tensor([5, 2])).tolist() == [9, 2]  # right after the output: it stays
    assert b.full_keep(torch.tensor([8, 2])).tolist() == [12, 2]
    # no environment token anywhere: the batch is the plain one
    b2 = VerifyBatch.from_responses([plain])
    assert b2.positions is None and b2.full_keep(torch.tensor([1])).tolist() == [1]


def _new_logprobs(r: Response, hot: dict[int, float]) -> np.ndarray:
    """The trainer's log-probs over every token of r: equal to the engine's at policy tokens but at `hot`;
    wildly off (and NaN) at the environment tokens, which must not matter."""
    new = np.where(r.sources == POLICY, r.logprobs, np.float32(-30.0)).astype(np.float32)
    new[np.flatnonzero(r.sources == ENVIRONMENT)[:1]] = np.nan
    for j, d in hot.items():
        new[j] = r.logprobs[j] + np.float32(math.log1p(d))
    return new


@pytest.mark.parametrize(
    ("hot", "keep", "why"),
    [
        ({2: 5.0}, 2, "cut inside the call, before its output: the output goes with it"),
        ({4: 5.0}, 4, "cut at the call's last token: the output it produced goes"),
        ({9: 5.0}, 9, "cut right after the output: the output of a whole call stays"),
        ({11: 5.0}, 11, "cut late: everything before stays"),
        ({}, 12, "no policy token off: environment tokens (even NaN, far off) never cut"),
    ],
)
def test_token_stage_cut_before_inside_and_after_a_tool_output(hot, keep, why):
    r = tool_response()
    outcome = RollVerify(d_s=math.inf, d_t=2.0).apply([r], [_new_logprobs(r, hot)], 2)
    assert outcome.keep_lengths.tolist() == [keep], why
    assert outcome.lengths.tolist() == [12]
    s = outcome.stats
    assert s["verified_tokens"] == 8 and s["env_tokens"] == 4  # acceptance counts policy tokens
    kept_policy = int((r.sources[:keep] == POLICY).sum())
    assert s["kept_tokens"] == kept_policy and s["acceptance_rate"] == pytest.approx(kept_policy / 8)
    assert s["env_kept_tokens"] == int((r.sources[:keep] == ENVIRONMENT).sum())
    assert math.isfinite(s["ops_mean"])  # over policy tokens only


def test_sequence_stage_segments_are_runs_of_policy_tokens():
    """The v0 segment is tokens 0-4, the v1 segment 9-11; the output between belongs to neither: a drifted v1
    segment cuts at its first token (9), leaving the call and its output."""
    r = tool_response()
    new = _new_logprobs(r, {9: 0.05, 10: 0.05, 11: 0.05})
    outcome = RollVerify(d_s=0.01, d_t=math.inf).apply([r], [new], 2)
    assert outcome.keep_lengths.tolist() == [9] and outcome.stats["segments"] == 2
    new = _new_logprobs(r, {0: 0.06})  # v0 segment mean 0.012 over its 5 policy tokens (0.0067 over 9)
    assert RollVerify(d_s=0.01, d_t=math.inf).apply([r], [new], 2).keep_lengths.tolist() == [0]
    new = _new_logprobs(r, {0: 0.04})
    assert RollVerify(d_s=0.01, d_t=math.inf).apply([r], [new], 2).keep_lengths.tolist() == [12]


def test_filters_and_switch_count_policy_tokens_only():
    r = tool_response()
    new = _new_logprobs(r, {})
    out = make_strategy("ops_filter", AlgoConfig(ops_gamma=0.01)).apply([r], [new], 2)
    assert out.keep_lengths.tolist() == [12]  # the env tokens' wild values do not enter the mean
    out = make_strategy("staleness_filter", AlgoConfig(staleness_s=2)).apply([r], None, 2)
    assert out.keep_lengths.tolist() == [12]  # staleness 2 from the v0 policy tokens, not from ENV_VERSION
    out = make_strategy("staleness_filter", AlgoConfig(staleness_s=1)).apply([r], None, 2)
    assert out.keep_lengths.tolist() == [0]
    out = make_strategy("partial").apply([r], None, 2)
    assert out.keep_lengths.tolist() == [12] and out.stats["verified_tokens"] == 8


def test_matches_the_naive_reference_on_random_multi_turn_responses():
    rng = np.random.default_rng(5)
    for trial in range(40):
        responses, news = [], []
        for i in range(int(rng.integers(1, 6))):
            r = Response(trial, i, np.array([1]), 400)
            version = 0
            for _turn in range(int(rng.integers(1, 5))):
                n = int(rng.integers(1, 12))
                r.append(rng.integers(0, 50, n), rng.normal(-1, 0.5, n), version, finished=False)
                version += int(rng.integers(0, 2))
                if rng.random() < 0.7:
                    r.append_environment(rng.integers(50, 60, int(rng.integers(1, 6))))
            new = r.logprobs.copy()
            drift = rng.random(r.num_tokens) < 0.1
            new[drift] += rng.normal(0, 1.5, int(drift.sum())).astype(np.float32)
            new[r.sources == ENVIRONMENT] = rng.normal(0, 5, r.num_env_tokens)
            responses.append(r)
            news.append(new)
        d_s, d_t = float(rng.choice([0.01, 0.2, math.inf])), float(rng.choice([0.5, 2.0, math.inf]))
        got = RollVerify(d_s, d_t).apply(responses, news, 3).keep_lengths.tolist()
        def cat(name: str, rs=responses) -> list:
            return [x for r in rs for x in getattr(r, name).tolist()]

        want = reference_verify_sources(cat("logprobs"), [x for n in news for x in n.tolist()], cat("versions"),
                                        cat("sources"), [r.num_tokens for r in responses], d_s, d_t)
        assert got == want, trial


def test_buffer_cut_counts_both_sources_and_a_checkpoint_keeps_them(tmp_path):
    b = RolloutBuffer()
    b.add_group(Group.new(0, [7, 8], n=2, max_new_tokens=32))
    r = b.get("0-0")
    r.append([10, 11, 12, 13, 14], np.full(5, -0.5), 0, finished=False)
    r.append_environment([20, 21, 22, 23])
    r.append([30, 31, 32], np.full(3, -0.25), 1, finished=False)
    b.save(tmp_path / "b.npz")
    back = RolloutBuffer.load(tmp_path / "b.npz").get("0-0")
    assert back.sources.tolist() == r.sources.tolist() and np.array_equal(back.logprobs, r.logprobs, equal_nan=True)
    cut = b.apply_truncation({"0-0": 7})
    assert (cut.policy, cut.env) == (3, 2)
    cut = b.apply_truncation({"0-0": 3})
    assert (cut.policy, cut.env) == (2, 2)
