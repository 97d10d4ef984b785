"""On-policy tail batching (`algo.tail_batching`) over the scripted engine and trainer: pure loop logic.

The property held: every token a step trains was sampled by the policy that step starts from, in regular rounds
(the first B of tail_launch x B groups), in long rounds (the deferred prompts together), and after RollVerify's
switch falls to on_policy; the deferred groups' partial responses are dropped, not resumed, and each waits for
exactly one long round.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import make_loop

from rollverify.loop import TAIL_KEYS
from rollverify.strategies import AlgoConfig


def _trained_versions(result) -> set[int]:
    return {int(v) for g in result.trained_groups for r in g.responses for v in r.versions}


def test_every_trained_token_is_the_steps_policy_and_deferred_prompts_train_in_long_rounds():
    loop, engine, trainer = make_loop("on_policy", tail_batching=True, tail_launch=2.0)
    b = loop.cfg.batch_groups
    deferred_ids: list[int] = []
    long_rounds = regular = 0
    dropped = 0
    for _ in range(12):
        version = loop.version
        waiting = [gid for gid, g in loop.buffer.groups.items() if not g.finished]
        result = loop.run_step()
        m = result.metrics
        assert set(TAIL_KEYS) <= set(m)
        assert _trained_versions(result) == {version}, "a trained token was sampled by another policy"
        assert len(result.trained_groups) == b
        trained = [g.group_id for g in result.trained_groups]
        if m["tail/long_round"]:
            long_rounds += 1
            # a long round generates exactly the B oldest waiting prompts, nothing new
            assert sorted(trained) == sorted(waiting)[:b] and len(waiting) >= b
            assert m["n_launched_groups"] == 0
        else:
            regular += 1
            assert len(waiting) < b  # a long round comes as soon as B wait
            assert m["n_launched_groups"] == 2 * b and m["tail/deferred_groups"] == b
            assert not set(trained) & set(waiting), "a waiting prompt ran in a regular round"
            dropped += m["tail/dropped_tokens"]
            deferred_ids += [gid for gid, g in loop.buffer.groups.items() if not g.finished and gid not in waiting]
        # the waiting groups hold no tokens and are off the engines
        for g in loop.buffer.groups.values():
            assert all(r.num_tokens == 0 for r in g.responses)
            assert not {r.response_id for r in g.responses} & engine.response_ids()
        assert m["tail/waiting_groups"] == sum(1 for g in loop.buffer.groups.values() if not g.finished)
    assert long_rounds >= 3 and regular >= 3
    assert dropped > 0 and loop.ledger.cut_tokens == dropped  # nothing else was cut
    assert len(deferred_ids) == len(set(deferred_ids))  # a deferred prompt waits once, then trains whole


def test_a_switch_falls_to_tail_batching_and_trains_no_stale_token_after_it():
    # drift large enough that acceptance collapses and the switch fires within a few steps
    loop, engine, trainer = make_loop("rollverify", drift=1.0, tail_batching=True, switch_window=2, d_s=0.01)
    switched_at = None
    for step in range(14):
        version = loop.version
        result = loop.run_step()
        m = result.metrics
        assert set(TAIL_KEYS) <= set(m)  # one record shape, before the switch too
        if switched_at is None and m["switched"]:
            switched_at = step
        elif switched_at is not None and step > switched_at + 1:
            assert loop.mode == "on_policy"
            assert _trained_versions(result) == {version}
            assert m["tail/long_round"] or m["tail/deferred_groups"] > 0
    assert switched_at is not None and switched_at < 10


def test_tail_batching_is_refused_where_the_run_never_generates_on_policy():
    with pytest.raises(ValueError, match="algo.tail_batching"):
        AlgoConfig(mode="partial", tail_batching=True)
    with pytest.raises(ValueError, match="algo.tail_launch"):
        AlgoConfig(mode="on_policy", tail_batching=True, tail_launch=1.0)
    AlgoConfig(mode="rollverify", tail_batching=True)  # its switch falls to on_policy


def test_without_tail_batching_on_policy_records_no_tail_keys():
    loop, _, _ = make_loop("on_policy")
    m = loop.run_step().metrics
    assert not set(TAIL_KEYS) & set(m)
    assert not set(TAIL_KEYS) & loop.record_keys()
    assert np.isfinite(m["reward_mean"])
