"""RolloutBuffer: group completion order, carry-over, truncation, resume requests, pickle-free checkpoints."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from rollverify.buffer import RolloutBuffer
from rollverify.types import Group


def filled_buffer():
    """Groups 0..2 of n=2, budget 8. Group 1 finishes first, then group 0; group 2 stays partial."""
    b = RolloutBuffer()
    for g in range(3):
        b.add_group(Group.new(g, [100 + g, 7], n=2, max_new_tokens=8, label=str(g)))
    b.record("1-0", [1, 2], [-0.1, -0.2], 0, finish_reason="stop")
    b.record("0-0", [1], [-0.1], 0, finish_reason="length")
    assert b.record("1-1", [3], [-0.3], 0, finish_reason="stop")  # completes group 1
    assert not b.record("0-1", [4, 5], [-0.1, -0.1], 0)  # paused
    assert b.record("0-1", [6], [-0.1], 1, finish_reason="stop")  # resumed under v1, completes group 0
    b.record("2-0", [1, 2, 3], [-0.1, -0.1, -0.1], 1)  # paused mid-generation
    return b


def test_finished_groups_leave_in_completion_order():
    b = filled_buffer()
    assert b.num_finished == 2
    batch = b.pop_finished(1)
    assert [g.group_id for g in batch] == [1]
    assert [g.group_id for g in b.pop_finished()] == [0]
    assert list(b.groups) == [2] and b.num_finished == 0


def test_carried_over_are_all_responses_with_tokens_left_behind():
    b = filled_buffer()
    b.pop_finished(1)  # group 1 trains; group 0 is finished but left for the next step
    ids = [r.response_id for r in b.carried_over()]
    assert ids == ["0-0", "0-1", "2-0"]
    assert [r.staleness(2) for r in b.carried_over()] == [2, 2, 1]
    assert sum(r.num_tokens for r in b.carried_over()) == 1 + 3 + 3 and b.num_finished == 1


def test_truncation_reopens_a_finished_group():
    b = filled_buffer()
    b.pop_finished(1)
    cut = b.apply_truncation({"0-1": 2, "2-0": 0, "0-0": 1})
    assert (cut.policy, cut.env, cut.total) == (1 + 3, 0, 1 + 3)
    assert b.num_finished == 0  # 0-1 lost a token: group 0 is no longer complete
    r = b.get("0-1")
    assert r.token_ids.tolist() == [4, 5] and not r.finished and r.remaining_budget == 6
    assert b.get("0-0").finished  # kept whole: stays finished


def test_pending_resumes_continuations_first_with_remaining_budget():
    b = filled_buffer()
    b.pop_finished()
    b.apply_truncation({"2-0": 2})
    pending = b.pending()
    assert [(r.response_id, r.num_tokens, r.remaining_budget) for r in pending] == [("2-0", 2, 6), ("2-1", 0, 8)]
    assert pending[0] is b.get("2-0")  # the buffer's own record: the engine resubmits it as it is
    assert pending[0].prompt_ids.tolist() == [102, 7] and pending[0].token_ids.tolist() == [1, 2]


def test_lookup_and_duplicate_errors():
    b = filled_buffer()
    with pytest.raises(KeyError, match="no response '9-0'"):
        b.get("9-0")
    with pytest.raises(KeyError, match="no response 'x'"):
        b.get("x")
    with pytest.raises(ValueError, match="group 0 is already in the buffer"):
        b.add_group(Group.new(0, [1], 1, 4))
    with pytest.raises(ValueError, match="starts at token 2 but the buffer holds 3"):  # a delta lost or repeated
        b.record("2-0", [4], [-0.1], 1, offset=2)
    b.record("2-0", [4], [-0.1], 1, offset=3)
    assert b.get("2-0").num_tokens == 4


def assert_same(a: RolloutBuffer, b: RolloutBuffer):
    assert list(a.groups) == list(b.groups) and a.completed == b.completed
    for ga, gb in zip(a.groups.values(), b.groups.values(), strict=True):
        assert ga.n == gb.n and ga.metadata == gb.metadata and ga.prompt_ids.tolist() == gb.prompt_ids.tolist()
        for ra, rb in zip(ga.responses, gb.responses, strict=True):
            for name in ("token_ids", "logprobs", "versions", "sources", "routed_experts"):
                x, y = getattr(ra, name), getattr(rb, name)
                assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True))
            assert (ra.finished, ra.finish_reason, ra.reward, ra.max_new_tokens) == (
                rb.finished, rb.finish_reason, rb.reward, rb.max_new_tokens
            )


def test_checkpoint_round_trip_without_pickle(tmp_path):
    b = filled_buffer()
    g = Group.new(5, [1], n=1, max_new_tokens=4)
    b.add_group(g)
    b.record("5-0", [9, 9], [-0.5, -0.25], [2, 3], np.arange(2 * 3 * 2).reshape(2, 3, 2))
    b.get("1-0").reward = 1.0
    meta, arrays = b.to_state()
    json.dumps(meta)  # JSON-able
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    assert_same(b, RolloutBuffer.from_state(meta, arrays))

    path = tmp_path / "buffer.npz"
    b.save(path)
    with zipfile.ZipFile(path) as z:  # plain .npy members only
        assert all(n.endswith(".npy") for n in z.namelist())
    restored = RolloutBuffer.load(path)
    assert_same(b, restored)
    assert [g.group_id for g in restored.pop_finished()] == [1, 0]


def test_checkpoint_rejects_non_json_metadata():
    b = RolloutBuffer()
    b.add_group(Group.new(0, [1], 1, 4, label=object()))
    with pytest.raises(ValueError, match="group 0 metadata must be JSON-able"):
        b.to_state()


def test_one_verification_round_through_a_strategy():
    """The loop's use: carried-over set -> strategy -> decisions -> buffer -> what resumes."""
    from rollverify.strategies import AlgoConfig, make_strategy

    b = filled_buffer()
    b.pop_finished(1)
    carried = b.carried_over()  # 0-0 (v0), 0-1 (v0, v0, v1), 2-0 (v1 x3)
    new = [r.logprobs.copy() for r in carried]
    new[1][2] += np.float32(np.log(4.0))  # 0-1's v1 token drifted: D = 3
    strategy = make_strategy("rollverify", AlgoConfig(conditional_switch=False))
    outcome = strategy.apply(carried, new, policy_version=2)
    assert outcome.decisions == {"0-0": 1, "0-1": 2, "2-0": 3}
    b.apply_truncation(outcome.decisions)
    assert b.num_finished == 0
    assert [(r.response_id, r.remaining_budget) for r in b.pending()] == [("0-1", 6), ("2-0", 5), ("2-1", 8)]
