"""Pure-logic tests of the step loop's bookkeeping against a scripted engine and trainer (tests/fakes.py).

The real engine and trainer run the same loop in tests/test_train_e2e.py. Here the point is the loop's own
logic: phase boundaries, carry-over, accounting, verification wiring and switching, over many steps in
milliseconds.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from fakes import ScriptedEngine, ScriptedTrainer, make_loop

from rollverify.buffer import RolloutBuffer
from rollverify.loop import Loop
from rollverify.rollout import InMemoryWeights, Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.types import Group


@pytest.mark.parametrize("mode", ["on_policy", "partial", "staleness_filter", "ops_filter", "rollverify", "spec_rl"])
def test_every_mode_trains_b_groups_per_step_and_keeps_the_accounting(mode):
    loop, engine, trainer = make_loop(mode, drift=0.001)
    for _ in range(12):
        m = loop.run_step().metrics  # Ledger.check runs inside
        assert m["n_finished_groups"] == 4
    assert trainer.steps == [8] * 12
    assert engine.updates == list(range(1, 13))
    if mode == "on_policy":
        assert not loop.buffer.groups and not engine.tracked
    else:
        assert loop.ledger.launched > 12 * 8  # the engines were kept full beyond the batch


def test_partial_keeps_everything_and_rollverify_cuts_drifted_suffixes():
    partial, _, _ = make_loop("partial", drift=0.5)
    verified, _, _ = make_loop("rollverify", drift=0.5, conditional_switch=False)
    for _ in range(6):
        partial.run_step()
        verified.run_step()
    assert partial.ledger.cut_tokens == 0
    assert verified.ledger.cut_tokens > 0


VERIFY_STATS = {
    "responses", "verified_tokens", "kept_tokens", "acceptance_rate", "kept_whole_rate", "restarted", "truncated",
    "staleness_mean", "staleness_max", "ops_mean", "ops_response_mean", "ops_response_max",
    "ops_nonfinite_responses", "ops_segment_mean", "segments", "cut_by_seq_stage", "cut_by_token_stage",
    "switch_estimate", "switched", "env_tokens", "env_kept_tokens",
}


@pytest.mark.parametrize("mode", ["partial", "rollverify"])
def test_strategy_statistics_reach_the_metrics_whole_and_ops_is_computed_once_a_step(mode, monkeypatch):
    import rollverify.strategies as strategies

    calls = []
    real = strategies.token_ops
    monkeypatch.setattr(strategies, "token_ops", lambda old, new, out=None: calls.append(old.numel()) or real(old, new))
    loop, _, _ = make_loop(mode, drift=0.05)
    for _ in range(3):
        before = len(calls)
        m = loop.run_step().metrics
        assert m["n_carried"] > 0
        carried_tokens = m["verify/verified_tokens"]
        assert calls[before:] == [carried_tokens]  # one OPS computation, over exactly the carried tokens
        assert m["ops_mean"] == m["verify/ops_mean"] > 0  # partial reports it too (monitor_ops)
        assert m["acceptance_rate"] == m["verify/acceptance_rate"]
        stats = {k.removeprefix("verify/") for k in m if k.startswith("verify/")}
        drift = {k for k in stats if k.startswith(("drift/", "whatif/"))}  # drift by age: calibration.py's
        assert "drift/age1_ops_mean" in drift and "whatif/ds_1e-02" in drift
        stats -= drift
        if mode == "rollverify":
            assert stats == VERIFY_STATS
            assert m["verify/cut_by_seq_stage"] + m["verify/cut_by_token_stage"] >= m["verify/truncated"]
        else:
            assert stats == {"responses", "verified_tokens", "kept_tokens", "acceptance_rate", "kept_whole_rate",
                             "restarted", "truncated", "staleness_mean", "staleness_max", "ops_mean", "env_tokens",
                             "env_kept_tokens"}


def test_the_weight_push_statistics_reach_the_metrics_whole_under_sync():
    class Counted(InMemoryWeights):  # a transport's figures: what it moved and what the trainer released
        def push(self, version):
            super().push(version)
            return {"bytes": 100.0 * version, "offload/params_bytes": 7.0}

    loop, engine, trainer = make_loop("rollverify", drift=0.01)
    loop.rollout.weights = Counted(engine, trainer)
    for step in (1, 2):
        m = loop.run_step().metrics
        assert {k: v for k, v in m.items() if k.startswith("sync/")} == {
            "sync/bytes": 100.0 * step, "sync/offload/params_bytes": 7.0}


def test_conditional_switch_fires_on_low_acceptance_and_stops_carrying_over():
    loop, engine, _ = make_loop("rollverify", drift=5.0, switch_window=2, switch_tau=0.5)
    modes, switched_at = [], None
    for step in range(8):
        m = loop.run_step().metrics
        modes.append(m["mode"])
        if m["switched"] and switched_at is None:
            switched_at = step
            assert m["verify/switched"] == 1.0 and m["verify/switch_estimate"] < 0.5
    assert switched_at is not None and switched_at >= 1  # the window must fill first
    assert modes[-1] == "on_policy"
    assert not loop.buffer.groups  # once on-policy, steps complete everything they launch
    assert not engine.tracked  # and every trained response was dropped from the engine


def test_restore_continues_from_the_buffer():
    loop, engine, trainer = make_loop("rollverify", drift=0.001)
    for _ in range(3):
        loop.run_step()
    state, buffer = loop.state(), loop.buffer
    fresh, engine2, _ = make_loop("rollverify", drift=0.001)
    fresh.trainer.version = trainer.version
    fresh.restore(state, buffer)
    m = fresh.run_step().metrics
    assert m["step"] == 4 and fresh.version == 4
    fresh.ledger.check(fresh.buffer)


@pytest.mark.parametrize("mode", ["partial", "rollverify", "on_policy"])
def test_a_lost_server_s_responses_are_resubmitted_from_the_buffer(mode):
    """The engine forgets half its responses mid-rollout (their output since the last report is gone), as when a
    server is lost: the loop resubmits the unfinished ones from its buffer, prefix intact, and the accounting
    invariant holds through later steps."""
    loop, engine, _ = make_loop(mode, drift=0.001)
    loop.run_step()
    wait_finished, seen = engine.wait_finished, {}

    def lose_half(timeout):
        if not seen:
            gone = sorted(engine.tracked)[::2]
            seen.update(prefixes={rid: loop.buffer.get(rid).num_tokens for rid in gone})
            for rid in gone:
                del engine.tracked[rid]
            engine.lost_ids = gone
        return wait_finished(timeout)

    submit, resubmitted = engine.submit, {}

    def record_submit(responses, sampling):
        lost = seen.get("prefixes", {})
        resubmitted.update({r.response_id: r.num_tokens for r in responses if r.response_id in lost})
        return submit(responses, sampling)

    engine.wait_finished, engine.submit = lose_half, record_submit
    m = loop.run_step().metrics  # Ledger.check runs inside
    engine.wait_finished, engine.submit = wait_finished, submit
    assert 0 < m["n_resubmitted"] == len(resubmitted) <= len(seen["prefixes"])
    assert all(n == seen["prefixes"][rid] for rid, n in resubmitted.items())  # from the prefix the buffer held
    for _ in range(3):
        loop.run_step()


class SeededEngine(ScriptedEngine):
    """Whether token p of a response ends it depends only on (response, p, policy version): what a sampler
    seeded per request gives. A response resubmitted from a checkpoint then continues as it would have."""

    def submit(self, responses, sampling):
        for r in responses:
            assert r.response_id not in self.tracked, f"{r.response_id} submitted twice"
            self.tracked[r.response_id] = {"len": r.num_tokens, "budget": r.max_new_tokens, "new": [], "done": False}

    def _ends(self, rid: str, p: int) -> bool:
        return zlib.crc32(f"{rid}:{p}:{self.version}".encode()) % 1000 < 50

    def wait_finished(self, timeout):
        if self.paused:
            return []
        out = []
        for rid in sorted(self.live):  # a fixed order: which groups complete first must not depend on history
            st = self.tracked[rid]
            for _ in range(self.speed):
                st["new"].append(self.version)
                st["len"] += 1
                if self._ends(rid, st["len"]) or st["len"] >= st["budget"]:
                    st["done"] = True
                    out.append(self._chunk(rid, "stop"))
                    break
        return out

    def truncate(self, keep):
        for rid, k in keep.items():
            assert self.paused and not self.tracked[rid]["new"]
            self.tracked[rid].update(len=k, done=False)


def test_resume_at_step_k_reaches_the_same_states_as_a_run_that_never_stopped(tmp_path):
    def new_loop() -> Loop:
        cfg = RolloutConfig(batch_groups=4, n=2, max_new_tokens=64, max_live=24, wait_s=0.0, phase_timeout_s=5)
        return Loop(AlgoConfig(mode="rollverify", d_s=0.01, switch_window=3),
                    Rollout(cfg, SeededEngine(), ScriptedTrainer(drift=0.006),
                            make_group=lambda gid: Group.new(gid, [3, 4, 5 + gid % 5], cfg.n, cfg.max_new_tokens),
                            reward=lambda group, response: float(response.num_tokens % 2)))

    a = new_loop()
    for _ in range(3):
        a.run_step()
    a.buffer.save(tmp_path / "buffer.npz")  # what Run.save writes: the buffer as .npz, the loop state as JSON
    state = json.loads(json.dumps(a.state()))
    b = new_loop()
    b.trainer.version = a.trainer.version  # the trainer's own checkpoint (tested in test_megatron_trainer)
    b.restore(state, RolloutBuffer.load(tmp_path / "buffer.npz"))
    b.engine.update_weights(b.trainer.export_weights(), b.version)  # as Run.restore does
    assert b.buffer.carried_over(), "the scenario needs responses carried over the checkpoint"

    def same(x: dict) -> dict:
        # all but wall-clock times; NaN (no carried-over responses) equals NaN
        return {k: "nan" if v != v else v for k, v in x.items() if not k.endswith("_s")}

    for _ in range(4):
        ma, mb = a.run_step().metrics, b.run_step().metrics
        assert same(ma) == same(mb)
    assert a.state() == b.state()  # step, version, ledger, switching window
    assert a.ledger.cut_tokens > state["ledger"]["cut_tokens"]  # verification cut something after the resume
    ra = {r.response_id: r for g in a.buffer.groups.values() for r in g.responses}
    rb = {r.response_id: r for g in b.buffer.groups.values() for r in g.responses}
    assert ra.keys() == rb.keys()
    for rid, r in ra.items():
        np.testing.assert_array_equal(r.token_ids, rb[rid].token_ids)
        np.testing.assert_array_equal(r.versions, rb[rid].versions)
        np.testing.assert_array_equal(r.logprobs, rb[rid].logprobs)


def _per_step(loop: Loop, steps: int) -> list[dict]:
    out = []
    for _ in range(steps):
        trained, cut = loop.ledger.trained_tokens, loop.ledger.cut_tokens
        m = loop.run_step().metrics  # Ledger.check runs inside
        out.append({**m, "trained": loop.ledger.trained_tokens - trained, "cut": loop.ledger.cut_tokens - cut,
                    "engine_groups": {rid.split("-")[0] for rid in loop.engine.tracked}})
    return out


def test_after_the_switch_no_backlog_is_generated_and_thrown_away():
    # a large over-provisioned backlog (~30 groups for B = 4) when partial acceptance switches to on_policy
    def run(mode: str, **algo) -> list[dict]:
        loop, _, _ = make_loop(mode, drift=0.006, **algo)
        loop.cfg.max_live = 48
        return _per_step(loop, 14)

    steps = run("rollverify", switch_window=2, switch_tau=0.5)
    at = next(i for i, m in enumerate(steps) if m["switched"])
    switch_step, after = steps[at], steps[at + 1 :]
    assert 1 <= at <= 4 and switch_step["n_carried"] > 40
    # the switch's whole cost: the backlog it sends back to the prompts, no more than one step's generation
    held_back = switch_step.get("backlog_cut_tokens", 0.0)
    wasted = held_back + sum(m["cut"] for m in after)
    assert 0 < wasted <= switch_step["tokens_generated"]
    assert len(switch_step["engine_groups"]) <= 4  # only the next step's groups stay on the engine
    for m in after:
        assert m["mode"] == "on_policy" and m["n_finished_groups"] == 4 and m["cut"] == 0
        assert m["response_length_mean"] == m["trained"] / 8  # B * n = 8 trained responses
    # after it, tokens generated per trained token as in pure on_policy (where they are equal)
    ratio = sum(m["tokens_generated"] for m in after) / sum(m["trained"] for m in after)
    on_policy = run("on_policy")
    pure = sum(m["tokens_generated"] for m in on_policy) / sum(m["trained"] for m in on_policy)
    assert abs(ratio / pure - 1) <= 0.10
    assert [m["n_launched_groups"] for m in after[:6]] == [0] * 6  # the backlog trains before new groups launch


@pytest.mark.parametrize("mode", ["on_policy", "partial", "staleness_filter", "ops_filter", "rollverify", "spec_rl"])
@pytest.mark.parametrize("verify_on", ["trainer", "engine"])
def test_every_step_record_holds_the_same_keys_whatever_the_step_held(mode, verify_on):
    """rollverify.metrics' rule: a figure a step had nothing to measure for (nothing carried over, no cut, the
    stages after the switch) is present, null; its count is 0. At max_live = n one group runs at a time and the
    phase ends at the B-th finish, so steps 1-2 carry nothing by construction; then the over-provisioned steps
    carry, cut and (rollverify, window 1) switch."""
    loop, engine, _ = make_loop(mode, drift=5.0, switch_window=1, verify_on=verify_on)
    engine.drift = 5.0
    keys, switched = [], False
    for step in range(6):
        loop.cfg.max_live = loop.cfg.n if step < 2 else 24
        m = loop.run_step().metrics
        if step < 2:
            assert m["n_carried"] == 0
        elif step == 2 and mode != "on_policy":
            assert m["n_carried"] > 0
        switched |= bool(m["switched"])
        keys.append(sorted(m))
    assert all(k == keys[0] for k in keys), [sorted(set(k) ^ set(keys[0])) for k in keys]
    assert switched == (mode == "rollverify")
