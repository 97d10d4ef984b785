"""Scripted stand-ins for the rollout engine and the trainer, shared by the loop's pure-logic tests
(tests/test_loop_logic.py, test_tool_loop_logic.py, test_verify_on_engine.py).

They stand in for nothing those tests claim to test: the real engine and trainer run the same loop in
tests/test_train_e2e.py. They let a test drive the loop's own logic (phase boundaries, carry-over, accounting,
verification wiring, switching) over many steps in milliseconds.
"""

from __future__ import annotations

import numpy as np

from rollverify.interfaces import Chunk
from rollverify.loop import Loop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.types import Group


class ScriptedEngine:
    """Each response has a fixed target length (long-tailed); every poll advances live responses by `speed`.

    Like the real extension it tracks a response until it is dropped: truncating a finished one makes it live
    again and `resume` relaunches it; a held one (`resume(hold=...)`) waits for `release`."""

    def __init__(self, seed: int = 0, speed: int = 4):
        self.rng = np.random.default_rng(seed)
        self.speed = speed
        self.tracked: dict[str, dict] = {}  # rid -> {"target", "len", "new" tokens since last report, ...}
        self.paused = False
        self.held: set[str] = set()
        self.version = 0
        self.updates = []
        self.lost_ids: list[str] = []  # forgotten as a lost server would be, handed out by lost()
        self.drift = 0.0  # compute_logprobs' drift per version

    def _target(self, budget: int) -> int:
        return int(min(budget, 1 + self.rng.pareto(1.2) * 6))

    def submit(self, responses, sampling):
        for r in responses:
            assert r.response_id not in self.tracked, f"{r.response_id} submitted twice"
            target = r.num_tokens + self._target(r.remaining_budget)
            self.tracked[r.response_id] = {
                "target": target, "len": r.num_tokens, "budget": r.max_new_tokens, "new": [], "done": False
            }

    @property
    def live(self):
        return [rid for rid, st in self.tracked.items() if not st["done"] and rid not in self.held]

    def _chunk(self, rid, reason):
        st = self.tracked[rid]
        ver = np.array(st["new"], np.int64)
        st["new"] = []
        return Chunk(rid, np.full(len(ver), 7, np.int32), np.full(len(ver), -1.0, np.float32), ver, None, reason)

    def wait_finished(self, timeout):
        if self.paused:
            return []
        out = []
        for rid in self.live:
            st = self.tracked[rid]
            n = min(self.speed, st["target"] - st["len"])
            st["new"] += [self.version] * n
            st["len"] += n
            if st["len"] >= st["target"]:
                st["done"] = True
                out.append(self._chunk(rid, "stop"))
        return out

    def pause(self):
        assert not self.paused, "pause while paused"
        self.paused = True
        return [self._chunk(rid, None) for rid in self.live]

    def truncate(self, keep):
        for rid, k in keep.items():
            if rid in self.lost_ids:
                continue  # as SGLangRolloutEngine: a lost server's ids wait for lost(), nothing to cut
            st = self.tracked[rid]
            assert self.paused or rid in self.held or st["done"], f"truncate of {rid} while it generates"
            assert k < st["len"], f"no-op truncation of {rid} sent"
            st["len"], st["done"] = k, False
            st["target"] = k + self._target(st["budget"] - k)

    def drop(self, rids):
        for rid in rids:
            del self.tracked[rid]
            self.held.discard(rid)

    def resume(self, hold=()):
        assert not self.held, "resume while responses are held"
        self.paused = False
        self.held = set(hold)

    def release(self, rids):
        rids = set(rids) - set(self.lost_ids)
        assert not self.paused and rids <= self.held, "release of responses not held"
        self.held -= rids

    def update_weights(self, buckets, version):
        list(buckets)
        self.version = version
        self.updates.append(version)

    def lost(self):
        lost, self.lost_ids = self.lost_ids, []
        return lost

    def compute_logprobs(self, responses):
        """verify_on: engine: the log-probs of its prefill under its weights, `drift` per version of staleness
        (ScriptedTrainer's)."""
        return [r.logprobs + self.drift * (self.version - r.versions) for r in responses]

    def response_ids(self):
        return set(self.tracked).union(self.lost_ids)


class ScriptedTrainer:
    """New log-probs drift from the engine's by `drift` per version of staleness."""

    def __init__(self, drift: float):
        self.drift = drift
        self.version = 0
        self.steps = []

    def compute_logprobs(self, responses, temperature):
        return [r.logprobs + self.drift * (self.version - r.versions) for r in responses]

    def train_step(self, responses, advantages, temperature, policy_version):
        assert policy_version == self.version
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
    cfg = RolloutConfig(batch_groups=4, n=2, max_new_tokens=64, max_live=24, wait_s=0.0, phase_timeout_s=5)
    loop = Loop(
        AlgoConfig(mode=mode, **algo),
        Rollout(cfg, engine, trainer, make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                reward=lambda group, response: float(response.num_tokens % 2)),
    )
    return loop, engine, trainer
