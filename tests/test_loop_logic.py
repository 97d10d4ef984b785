"""Pure-logic tests of the step loop's bookkeeping against a scripted engine and trainer.

These fakes stand in for nothing the tests claim to test: the real engine and trainer run the same loop in
tests/test_train_e2e.py. Here the point is the loop's own logic: phase boundaries, carry-over, accounting,
verification wiring and switching, over many steps in milliseconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from rollverify.interfaces import Chunk
from rollverify.loop import Loop, LoopConfig
from rollverify.strategies import AlgoConfig
from rollverify.types import Group


class ScriptedEngine:
    """Each response has a fixed target length (long-tailed); every poll advances live responses by `speed`."""

    def __init__(self, seed: int = 0, speed: int = 4):
        self.rng = np.random.default_rng(seed)
        self.speed = speed
        self.live: dict[str, dict] = {}  # rid -> {"target", "done", "pending" tokens since last return}
        self.paused: set[str] = set()
        self.version = 0
        self.updates = []

    def _target(self, budget: int) -> int:
        return int(min(budget, 1 + self.rng.pareto(1.2) * 6))

    def submit(self, responses, sampling):
        for r in responses:
            assert r.response_id not in self.live, f"{r.response_id} submitted twice"
            self.live[r.response_id] = {"target": self._target(r.remaining_budget), "tok": [], "ver": []}

    def _advance(self, rid):
        st = self.live[rid]
        n = min(self.speed, st["target"] - len(st["tok"]))
        st["tok"] += [7] * n
        st["ver"] += [self.version] * n

    def _chunk(self, rid, reason):
        st = self.live[rid]
        tok = np.array(st["tok"], np.int32)
        c = Chunk(rid, tok, np.full(len(tok), -1.0, np.float32), np.array(st["ver"], np.int64), None, reason)
        st["target"] -= len(tok)
        st["tok"], st["ver"] = [], []
        return c

    def wait_finished(self, timeout):
        out = []
        for rid in list(self.live):
            if rid in self.paused:
                continue
            self._advance(rid)
            if len(self.live[rid]["tok"]) >= self.live[rid]["target"]:
                out.append(self._chunk(rid, "stop"))
                del self.live[rid]
        return out

    def pause(self):
        out = [self._chunk(rid, None) for rid in self.live if rid not in self.paused]
        self.paused |= set(self.live)
        return out

    def truncate(self, keep):
        for rid in keep:
            assert rid in self.paused, f"truncate of {rid}, which is not paused on the engine"

    def drop(self, rids):
        for rid in rids:
            self.live.pop(rid, None)

    def resume(self):
        self.paused.clear()

    def update_weights(self, buckets, version):
        list(buckets)
        self.version = version
        self.updates.append(version)

    def num_live(self):
        return len(self.live)


class ScriptedTrainer:
    """New log-probs drift from the engine's by `drift` per version of staleness."""

    def __init__(self, drift: float):
        self.drift = drift
        self.version = 0
        self.steps = []

    def compute_logprobs(self, responses, temperature):
        return [r.logprobs + self.drift * (self.version - r.versions) for r in responses]

    def train_step(self, responses, advantages, temperature):
        assert all(r.finished for r in responses)
        assert len(advantages) == len(responses)
        self.steps.append(len(responses))
        self.version += 1
        return {"loss": 0.0}

    def export_weights(self):
        yield [("w", np.zeros(1))]

    def save(self, path):
        pass

    def load(self, path):
        pass


def make_loop(mode: str, drift: float = 0.0, **algo) -> tuple[Loop, ScriptedEngine, ScriptedTrainer]:
    engine, trainer = ScriptedEngine(), ScriptedTrainer(drift)
    cfg = LoopConfig(batch_groups=4, n=2, max_new_tokens=64, max_live=24, wait_s=0.0, phase_timeout_s=5)
    loop = Loop(
        cfg,
        AlgoConfig(mode=mode, **algo),
        engine,
        trainer,
        make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
        reward=lambda group, response: float(response.num_tokens % 2),
    )
    return loop, engine, trainer


@pytest.mark.parametrize("mode", ["on_policy", "partial", "staleness_filter", "ops_filter", "rollverify"])
def test_every_mode_trains_b_groups_per_step_and_keeps_the_accounting(mode):
    loop, engine, trainer = make_loop(mode, drift=0.001)
    for _ in range(12):
        m = loop.run_step().metrics  # Ledger.check runs inside
        assert m["n_finished_groups"] == 4
    assert trainer.steps == [8] * 12
    assert engine.updates == list(range(1, 13))
    if mode == "on_policy":
        assert not loop.buffer.groups and not engine.live
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


def test_conditional_switch_fires_on_low_acceptance_and_stops_carrying_over():
    loop, engine, _ = make_loop("rollverify", drift=5.0, switch_window=2, switch_tau=0.5)
    modes, switched_at = [], None
    for step in range(8):
        m = loop.run_step().metrics
        modes.append(m["mode"])
        if m["switched"] and switched_at is None:
            switched_at = step
    assert switched_at is not None and switched_at >= 1  # the window must fill first
    assert modes[-1] == "on_policy"
    assert not loop.buffer.groups  # once on-policy, steps complete everything they launch
    assert not engine.live


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
