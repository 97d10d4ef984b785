"""A rollout server killed mid-run: `rollverify train`'s own server, real SGLang and Megatron-Core.

The server process is SIGKILLed while it generates (the start of step 2's rollout phase, carried-over responses
resumed and fresh groups launched). The run must notice, restart the server with the current policy, resubmit
every unfinished response from what the controller holds, and go on with the accounting invariant intact
(`Loop.run_step` checks it after every step).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import psutil
import pytest

from rollverify.app.config import load_config
from rollverify.app.train import Run

pytestmark = [pytest.mark.engine, pytest.mark.megatron, pytest.mark.slow]  # ~55 s idle: the slow tier

CFG = [
    "rollout.batch_groups=2",
    "rollout.n=2",
    "rollout.max_new_tokens=48",
    "rollout.max_live=12",  # over-provisioned: responses are carried over into step 2
    "algo.mode=partial",  # no cuts: a resubmitted response must keep its prefix token for token
    "eval.every=0",
    "log.plots=false",
    "log.tensorboard=false",
    "trainer.lr=1e-4",
    "trainer.steps=3",
]


def test_killed_server_is_restarted_and_its_responses_resubmitted(tmp_path):
    (tmp_path / "run").mkdir()
    run = Run(load_config(None, CFG), tmp_path / "run")
    try:
        first = run.loop.run_step().metrics
        assert first["n_carried"] > 0, "the scenario needs carried-over responses"
        engine, loop, old = run.engine, run.loop, run.engine.pool.servers[0].process
        old_tree = [old.pid, *old.descendants()]
        seen: dict = {}
        wait_finished = engine.wait_finished

        def kill_then_wait(timeout: float):  # fault injection on the first wait of step 2's rollout
            if not seen:
                live = [r for g in loop.buffer.groups.values() for r in g.responses if not r.finished]
                seen.update(unfinished={rid for rid in engine.response_ids() if not loop.buffer.get(rid).finished},
                            prefixes={r.response_id: r.token_ids.copy() for r in live if r.num_tokens})
                os.kill(old.pid, signal.SIGKILL)
                old.proc.wait(30)
            return wait_finished(timeout)

        engine.wait_finished = kill_then_wait
        steps = [loop.run_step() for _ in range(2)]
        trained = [r for s in steps for g in s.trained_groups for r in g.responses]
        engine.wait_finished = wait_finished

        assert seen["prefixes"], "carried-over responses with tokens were live at the kill"
        assert len(engine.faults) == 1, engine.faults
        fault = engine.faults[0]
        lost = set(fault["lost"])
        moved = steps[0].metrics["n_resubmitted"]  # the loop resubmitted them from its buffer
        assert fault["restarted"] and seen["unfinished"] <= lost and 0 < moved <= len(seen["unfinished"])
        new = engine.pool.servers[0].process
        assert new.pid != old.pid and new.proc.poll() is None
        assert not [p for p in old_tree if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert run.loop.step == 3 and run.loop.ledger.trained == 3 * 2 * 2
        health = engine.health()[0]
        assert health["version"] == run.loop.version == 3  # the restarted server got every later update
        # a response carried across the kill keeps the prefix the controller held, token for token
        survivors = {r.response_id: r for r in trained}
        survivors.update({r.response_id: r for g in run.loop.buffer.groups.values() for r in g.responses})
        checked = 0
        for rid, prefix in seen["prefixes"].items():
            r = survivors.get(rid)
            if r is not None:
                np.testing.assert_array_equal(r.token_ids[: len(prefix)], prefix)
                checked += 1
        assert checked == len(seen["prefixes"])
        # nothing unfinished at the kill left the controller: trained, or still in the buffer
        assert seen["unfinished"] <= survivors.keys()
    finally:
        run.close()
