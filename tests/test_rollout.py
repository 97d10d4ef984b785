"""`Rollout`'s own definitions, which both schedules use (rollverify/rollout.py), against the scripted engine of
tests/fakes.py: what "live" counts, a cut applied to the buffer and the ledger at once and to the engine
at `send`, shelving, the step's decode iterations."""

from __future__ import annotations

import numpy as np
from fakes import ScriptedEngine, ScriptedTrainer

from rollverify.interfaces import Chunk
from rollverify.rollout import Rollout, RolloutConfig, StepCounts, trained_ops
from rollverify.types import Group


class Recording(ScriptedEngine):
    """Records the order of the calls that change what the engine holds."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def truncate(self, keep):
        self.calls.append(("truncate", dict(keep)))
        super().truncate(keep)

    def drop(self, rids):
        rids = list(rids)
        self.calls.append(("drop", rids))
        super().drop(rids)


def make(max_live: int = 8) -> Rollout:
    cfg = RolloutConfig(batch_groups=1, n=2, max_new_tokens=64, max_live=max_live, wait_s=0.0, phase_timeout_s=5)
    return Rollout(cfg, Recording(), ScriptedTrainer(0.0),
                   make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                   reward=lambda group, response: 1.0)


def test_live_counts_unfinished_buffer_responses_the_engines_hold():
    r = make(max_live=8)
    assert r.fill() == [0, 1, 2, 3] and r.live() == 8  # n = 2 each, up to max_live
    assert r.fill() == []  # no room
    rid = "0-0"
    r.record([Chunk(rid, np.full(3, 7, np.int32), np.zeros(3, np.float32), np.zeros(3, np.int64), None, "stop")])
    assert r.live() == 7  # finished: not live, though the engine holds it until it is dropped
    r.record([Chunk("0-1", np.full(2, 7, np.int32), np.zeros(2, np.float32), np.zeros(2, np.int64), None, "stop")])
    (group,) = r.buffer.pop_finished(1)
    assert r.live() == 6 and "0-0" in r.engine.response_ids()  # a group a step has taken is not live either
    del r.engine.tracked["1-0"]  # held off the engines (a lost server's, a shelved one): not live
    assert r.live() == 5
    assert r.fill() == [4] and r.counts.launched_groups == 5


def test_a_cut_reaches_buffer_and_ledger_at_once_and_the_engine_at_send():
    r = make()
    r.fill()
    r.engine.pause()
    chunks = [Chunk(f"{g}-{i}", np.full(6, 7, np.int32), np.zeros(6, np.float32), np.zeros(6, np.int64), None, None)
              for g in range(4) for i in range(2)]
    r.record(chunks)
    for st in r.engine.tracked.values():  # what the scripted engine generated: the recorded chunks
        st["len"] = 6
    counts = r.cut({"0-0": 2, "0-1": 6, "1-0": 0})  # 0-1 kept whole: no cut
    assert counts.policy == 4 + 6 and r.ledger.cut_tokens == 10 and r.ledger.restarted == 1
    assert r.buffer.get("0-0").num_tokens == 2 and r.engine.calls == []  # the engine not yet
    r.send()
    assert r.engine.calls == [("truncate", {"0-0": 2, "1-0": 0})]
    r.ledger.check(r.buffer)  # 48 generated = 38 buffered + 10 cut


def test_shelving_drops_instead_of_truncating_and_keeps_the_first_groups():
    r = make()
    r.fill()
    r.engine.pause()
    r.record([Chunk(f"{g}-{i}", np.full(4, 7, np.int32), np.zeros(4, np.float32), np.zeros(4, np.int64), None, None)
              for g in range(4) for i in range(2)])
    for rid in r.engine.tracked:
        r.engine.tracked[rid]["len"] = 4
    r.cut({"2-0": 1})
    ids, counts = r.shelve()  # B = 1: group 0 stays, the rest go back to their prompts, off the engines
    assert ids == {f"{g}-{i}" for g in (1, 2, 3) for i in range(2)} and counts.policy == 6 * 4 - 3
    r.send()
    assert r.engine.calls == [("drop", sorted(ids))]  # the cut of 2-0 is not sent: the response leaves
    assert all(r.buffer.get(x).num_tokens == 0 for x in ids) and r.buffer.get("0-0").num_tokens == 4


def test_decode_iters_is_the_most_policy_tokens_one_response_received_in_the_step():
    r = make()
    r.fill()
    r.begin_step()
    out = [Chunk("0-0", np.full(3, 7, np.int32), np.zeros(3, np.float32), np.zeros(3, np.int64), None, None),
           Chunk("1-0", np.full(5, 7, np.int32), np.zeros(5, np.float32), np.zeros(5, np.int64), None, None),
           Chunk("0-0", np.full(4, 7, np.int32), np.zeros(4, np.float32), np.zeros(4, np.int64), None, None)]
    r.record(out)
    figures = r.counts.figures(r.ledger)
    assert figures["decode_iters"] == 7 and figures["tokens_generated"] == 12  # 3 + 4 to one response
    assert StepCounts().figures(r.ledger)["decode_iters"] == 0


def test_trained_ops_weighs_both_halves_by_tokens_and_drops_what_is_not_finite():
    assert trained_ops({"mismatch_tokens": 3, "mismatch_ops_mean": 0.1, "drift_tokens": 1,
                        "drift_ops_mean": 0.5})["trained_ops_mean"] == 0.2
    assert np.isnan(trained_ops({"mismatch_tokens": 3, "mismatch_ops_mean": float("inf")})["trained_ops_mean"])
    assert np.isnan(trained_ops({"mismatch_tokens": 0, "mismatch_ops_mean": float("nan")})["trained_ops_mean"])
