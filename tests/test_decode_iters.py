"""decode_iters, the hardware-neutral rollout time, measured through a real SGLang server: the loop's figure is
the number of sequential decode iterations of a rollout phase, not the number of tokens the phase made."""

from __future__ import annotations

import math

import pytest
from engine_fixtures import reset_server, run

from rollverify.app.demo import ratio_interval, verdict
from rollverify.loop import Loop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.types import Group
from sglang_ext.rollout_engine import SGLangRolloutEngine

pytest_plugins = ["engine_fixtures"]  # the session servers, shared with the other sglang_ext tests


def _loop(engine, mode: str, batch_groups: int, n: int, max_new: int, max_live: int) -> Loop:
    cfg = RolloutConfig(batch_groups=batch_groups, n=n, max_new_tokens=max_new, max_live=max_live, wait_s=0.05,
                     phase_timeout_s=600)
    return Loop(AlgoConfig(mode=mode), Rollout(cfg, engine, trainer=None,
                                               make_group=lambda gid: Group.new(gid, [5 + gid, 7, 9, 11], n, max_new),
                                               reward=lambda group, response: 0.0))


@pytest.mark.engine
def test_a_batch_decodes_in_about_its_longest_response_not_its_token_count(dense_server):
    run(reset_server(dense_server))
    with SGLangRolloutEngine([dense_server.endpoint], curve=dense_server.curve, poll_wait_s=0.1) as engine:
        # on_policy: 2 groups x 8 responses of up to 40 tokens, launched together, run until all finish
        loop = _loop(engine, "on_policy", batch_groups=2, n=8, max_new=40, max_live=16)
        m = loop.rollout_phase()
        lengths = [r.num_tokens for g in loop.buffer.groups.values() for r in g.responses]
        assert len(lengths) == 16 and all(g.finished for g in loop.buffer.groups.values())
        assert m["decode_iters"] == max(lengths) <= 40
        assert m["tokens_generated"] == sum(lengths) >= 4 * m["decode_iters"]  # about L, not n * L
        engine.drop([r.response_id for g in loop.buffer.groups.values() for r in g.responses])


def test_verdict_states_ratios_with_intervals_and_the_eval_difference():
    assert ratio_interval(50.0, 0.0, 100.0, 0.0) == (0.5, 0.5, 0.5)
    r, lo, hi = ratio_interval(50.0, 5.0, 100.0, 0.0)  # 10 % relative error -> +- 1.96 * 0.05
    assert r == 0.5 and math.isclose(lo, 0.5 - 0.098) and math.isclose(hi, 0.5 + 0.098)
    results = {
        "on_policy": {"priced": 200.0, "priced_se": 0.0, "decode_iters": 100.0, "generated_per_trained": 1.0,
                      "step_s": 2.0, "eval_last": 0.40, "eval_se": 0.010},
        "rollverify": {"priced": 100.0, "priced_se": 10.0, "decode_iters": 50.0, "generated_per_trained": 1.31,
                       "step_s": 1.5, "eval_last": 0.38, "eval_se": 0.010},
    }
    (line,) = verdict(results)
    assert line == (
        "rollverify / on_policy: priced cost 0.50x [0.40, 0.60] (decode iterations 0.50x, tokens generated per "
        "trained 1.31 vs 1.00); eval reward 0.380 +- 0.020 [0.360, 0.400] vs 0.400 +- 0.020 [0.380, 0.420]: "
        "difference -0.020 +- 0.028 (within the noise)"
    )
    results["rollverify"]["eval_last"] = 0.34
    assert verdict(results)[0].endswith("difference -0.060 +- 0.028 (below)")
