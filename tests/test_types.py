"""Response, Group and VerifyBatch: per-token fields stay together through append and truncate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollverify.types import Group, Response, VerifyBatch


def make(n_tokens=0, routes=False, budget=16, versions=0):
    r = Response(group_id=3, index=1, prompt_ids=[1, 2, 3], max_new_tokens=budget)
    if n_tokens:
        ex = np.arange(n_tokens * 2 * 2).reshape(n_tokens, 2, 2) if routes else None
        r.append(np.arange(n_tokens) + 10, -np.arange(n_tokens) / 10, versions, ex)
    return r


def per_token_lengths(r: Response) -> set[int]:
    fields = [r.token_ids, r.logprobs, r.versions] + ([r.routed_experts] if r.routed_experts is not None else [])
    return {len(f) for f in fields}


def test_append_stores_typed_per_token_fields():
    r = make()
    r.append([5, 6], [-0.5, -0.25], 2, np.zeros((2, 4, 2)))
    r.append([7], [-1.0], [3], np.ones((1, 4, 2)), finish_reason="stop")
    assert r.response_id == "3-1"
    assert r.token_ids.dtype == np.int32 and r.logprobs.dtype == np.float32 and r.versions.dtype == np.int64
    assert r.routed_experts.dtype == np.int32 and r.routed_experts.shape == (3, 4, 2)
    assert r.versions.tolist() == [2, 2, 3]
    assert r.finished and r.finish_reason == "stop"
    assert r.remaining_budget == 13
    assert r.staleness(5) == 3


def test_abort_or_no_reason_means_paused():
    r = make()
    r.append([1], [-0.1], 0, finish_reason="abort")
    assert not r.finished
    r.append([2], [-0.1], 0)
    assert not r.finished and r.finish_reason is None
    r.append([3], [-0.1], 0, finish_reason="length")
    assert r.finished


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r: r.append([1, 2], [-0.1], 0), "one logprob and one version per token"),
        (lambda r: r.append([1, 2], [-0.1, -0.2], [0]), "one logprob and one version per token"),
        (lambda r: r.append([1], [-0.1], 0, np.zeros((2, 1, 1))), "one row per new token"),
        (lambda r: r.append([1], [-0.1], 0, np.zeros((1, 1))), "routed_experts must be a 3-D array"),
        (lambda r: r.append(list(range(20)), [-0.1] * 20, 0), "exceeds the remaining budget"),
        (lambda r: r.append([1], [-0.1], 0, finish_reason="eos"), "finish_reason must be one of"),
    ],
)
def test_append_rejects_ragged_input(call, match):
    r = make()
    with pytest.raises(ValueError, match=match):
        call(r)
    assert r.num_tokens == 0  # nothing half-applied


def test_routes_must_be_all_or_nothing():
    r = make(2, routes=True)
    with pytest.raises(ValueError, match="routed_experts missing"):
        r.append([1], [-0.1], 0)
    with pytest.raises(ValueError, match=r"routed_experts must be \[tokens, 2, 2\]"):
        r.append([1], [-0.1], 0, np.zeros((1, 3, 2)))
    plain = make(2)
    with pytest.raises(ValueError, match="tokens without routes"):
        plain.append([1], [-0.1], 0, np.zeros((1, 2, 2)))


def test_cannot_append_to_a_finished_response():
    r = make(2)
    r.append([1], [-0.1], 0, finish_reason="stop")
    with pytest.raises(ValueError, match="is finished"):
        r.append([1], [-0.1], 0)


def test_constructor_validates_lengths():
    with pytest.raises(ValueError, match="logprobs must have one row per generated token"):
        Response(0, 0, [1], 8, token_ids=[1, 2], logprobs=[-0.1], versions=[0, 0])
    with pytest.raises(ValueError, match="max_new_tokens"):
        Response(0, 0, [1], 1, token_ids=[1, 2], logprobs=[-0.1, -0.1], versions=[0, 0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.booleans(), st.data())
def test_truncate_cuts_every_field_together(chunks, routes, data):
    r = make(budget=64)
    for version, n in enumerate(chunks):
        r.append(np.arange(n), np.full(n, -0.5), version, np.zeros((n, 2, 2)) if routes else None)
    r.append([9], [-0.1], len(chunks), np.zeros((1, 2, 2)) if routes else None, finish_reason="stop")
    r.reward = 1.0
    before = r.token_ids.copy(), r.versions.copy()
    keep = data.draw(st.integers(0, r.num_tokens))
    cut = r.truncate(keep)
    assert cut == len(before[0]) - keep
    assert per_token_lengths(r) == {keep}
    assert r.token_ids.tolist() == before[0][:keep].tolist()
    assert r.versions.tolist() == before[1][:keep].tolist()  # kept tokens keep their versions
    assert r.finished == (cut == 0) and (r.reward is None) == (cut > 0)
    assert r.remaining_budget == 64 - keep


def test_truncate_bounds():
    r = make(3)
    with pytest.raises(ValueError, match=r"keep_len must be in \[0, 3\]"):
        r.truncate(4)
    with pytest.raises(ValueError, match=r"keep_len must be in \[0, 3\]"):
        r.truncate(-1)
    assert r.truncate(3) == 0 and r.num_tokens == 3


def test_truncated_arrays_do_not_alias_the_old_ones():
    r = make(4)
    old_tokens = r.token_ids
    r.truncate(2)
    old_tokens[0] = 999
    assert r.token_ids[0] == 10


def test_group_new_and_finished():
    g = Group.new(7, [1, 2], n=3, max_new_tokens=8, label="42")
    assert [r.response_id for r in g.responses] == ["7-0", "7-1", "7-2"]
    assert g.metadata == {"label": "42"} and not g.finished
    for r in g.responses:
        r.append([1], [-0.1], 0, finish_reason="stop")
    assert g.finished
    assert np.isnan(g.rewards).all()
    with pytest.raises(ValueError, match="needs n=2 responses"):
        Group(1, [1], 2, [])


def test_packed_batch_round_trip():
    rs = [make(3, versions=1), make(0), make(2, versions=2)]
    rs[2].index = 2
    b = VerifyBatch.from_responses(rs)
    assert b.response_ids == ["3-1", "3-1", "3-2"]
    assert b.lengths.tolist() == [3, 0, 2]
    assert b.versions.dtype == torch.int64 and b.versions.tolist() == [1, 1, 1, 2, 2]
    assert b.logprobs.dtype == torch.float32 and b.num_tokens == 5
    parts = torch.split(b.logprobs, b.lengths.tolist())
    assert [p.tolist() for p in parts] == [r.logprobs.tolist() for r in rs]


def test_packed_batch_empty():
    b = VerifyBatch.from_responses([])
    assert b.num_tokens == 0 and b.lengths.tolist() == [] and b.logprobs.tolist() == []
