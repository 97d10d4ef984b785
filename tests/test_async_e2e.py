"""The asynchronous schedule end to end: a real SGLang server generating while the real Megatron-Core trainer
trains (on the loop's worker thread), over several versions, on the tiny MoE (routing replay on).

Every step checks the ledger (`AsyncLoop.run_step`). The trainer is wrapped to keep, for each step, what it was
handed: the old log-probs the step verified with (which must be the trainer's own at that moment) and the
trained responses' tokens, so that the test checks independently that each trained token passes both stages
against the step's policy and lies within the staleness bound.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
from e2e_checks import REWARD, check_verified, watch_trainer
from engine_fixtures import SMALL_RUN, reset_server, run

from rollverify.app.config import load_config
from rollverify.app.train import Run

pytestmark = [pytest.mark.engine, pytest.mark.megatron]
pytest_plugins = ["engine_fixtures"]  # the session's tiny MoE server

ASYNC = [
    *SMALL_RUN,
    "model.moe=true",
    "model.task=null",
    f"task.reward={REWARD}",
    "rollout.max_new_tokens=64",
    "rollout.max_live=12",  # 3x B * n: groups in flight while the trainer works
    "algo.schedule=async",
    "algo.mode=rollverify",
    "algo.max_staleness=3",
    "algo.conditional_switch=false",  # the schedule itself (tests/test_async_loop.py holds the fallback)
    "trainer.lr=1e-6",  # carried prefixes mostly pass (at 1e-4 the tiny MoE's drift cuts nearly every one)
    "cluster.placement=disaggregated",
    "eval.every=0",
    "log.export_final=false",
]


@pytest.fixture
def tiny_moe(moe_server):
    run(reset_server(moe_server))
    return moe_server


def test_servers_generate_while_the_trainer_trains_with_every_trained_token_verified(tiny_moe, tmp_path):
    # max_live B * n bounds the groups launched under version 0 whatever the load: a group launches only while
    # fewer than B finished groups wait and n responses fit beside the live ones, so at most max_live - n + 2 = 4
    # groups wait untrained at any time, and at most 2 + 4 of the 8 trained groups were launched before version 1
    cfg = load_config(None, [*ASYNC, "trainer.steps=4", "rollout.max_live=4",
                             f"servers.endpoints=[\"{tiny_moe.endpoint}\"]"])
    (tmp_path / "run").mkdir()
    r = Run(cfg, tmp_path / "run")
    try:
        steps = watch_trainer(r)
        rows = [r.loop.run_step().metrics for _ in range(4)]  # the ledger is checked after every step
        assert [m["policy_version"] for m in rows] == [1, 2, 3, 4]
        assert all(m["schedule"] == "async" for m in rows)
        assert r.loop.ledger.trained == 4 * 2 * 2
        assert r.engine.health()[0]["version"] == 4
        check_verified(steps, cfg)
        # the driver kept polling the engines while every step trained (what finished then is the load's affair)
        assert all(s["polled_meanwhile"] for s in steps)
        assert sum(m["tokens_generated"] for m in rows) > sum(m["trained_tokens"] for m in rows) > 0
        versions = {int(v) for s in steps for _, ver in s["tokens"] for v in ver}
        assert len(versions) >= 2  # step 1 trained version 0's tokens; the last steps' groups launched later
    finally:
        r.close()


def test_a_checkpoint_with_a_full_queue_resumes_with_nothing_lost_or_duplicated(tiny_moe, tmp_path):
    over = [*ASYNC, "trainer.steps=3", f"servers.endpoints=[\"{tiny_moe.endpoint}\"]", "algo.queue_groups=3"]
    cfg = load_config(None, over)
    (tmp_path / "a").mkdir()
    first = Run(cfg, tmp_path / "a")
    try:
        for _ in range(2):
            first.loop.run_step()
        first.loop.await_finished(3)  # the queue is full: the trainer would be busy elsewhere now
        queue = list(first.loop.buffer.completed)
        pending = {x.response_id: x.num_tokens for x in first.loop.buffer.pending()}
        ledger = json.dumps(first.loop.state()["ledger"])
        saved = set(first.loop.buffer.groups)
        next_id = first.loop.next_group_id
        first.save()
    finally:
        first.close()
    run(reset_server(tiny_moe))  # the resumed run's server holds nothing
    (tmp_path / "b").mkdir()
    second = Run(cfg, tmp_path / "b")
    try:
        second.restore(tmp_path / "a")
        assert second.loop.buffer.completed == queue and len(queue) >= 3
        assert {x.response_id: x.num_tokens for x in second.loop.buffer.pending()} == pending
        assert json.dumps(second.loop.state()["ledger"]) == ledger
        steps = watch_trainer(second)
        m = second.loop.run_step().metrics
        assert m["queue_groups_at_start"] == len(queue) and m["policy_version"] == 3
        assert second.loop.ledger.trained == 3 * 2 * 2
        check_verified(steps, cfg)
        # what the step trained was in the checkpoint (the queue's, or in flight) or launched after it: no group
        # trained before the checkpoint came back
        (trained,) = [s["groups"] for s in steps]
        assert all(g in saved or g >= next_id for g in trained)
    finally:
        second.close()


@pytest.mark.slow
def test_a_server_killed_mid_run_is_restarted_and_nothing_is_lost(tmp_path):
    """The run's own server (and two trainer ranks in child processes): SIGKILLed while a step's trainer call
    runs and responses are live; the run restarts it with the current policy and resubmits what it held."""
    cfg = load_config(None, [*ASYNC, "trainer.steps=4", "trainer.dp=2", "servers.timeout_s=600"])
    (tmp_path / "run").mkdir()
    r = Run(cfg, tmp_path / "run")
    try:
        steps = watch_trainer(r)
        r.loop.run_step()
        old = r.engine.pool.servers[0].process
        wait_finished = r.engine.wait_finished
        killed: dict = {}

        def kill_then_wait(timeout: float):
            live = [x for x in r.loop.buffer.pending() if x.num_tokens]
            if not killed and live and threading.active_count() > 1:
                killed["prefixes"] = {x.response_id: x.token_ids.copy() for x in live}
                os.kill(old.pid, signal.SIGKILL)
                old.proc.wait(30)
            return wait_finished(timeout)

        r.engine.wait_finished = kill_then_wait
        rows = [r.loop.run_step().metrics for _ in range(3)]
        r.engine.wait_finished = wait_finished
        assert killed, "no response with tokens was live"
        (fault,) = r.engine.faults
        assert fault["restarted"]
        assert sum(m["n_resubmitted"] for m in rows) > 0
        assert r.loop.ledger.trained == 4 * 2 * 2 and r.engine.health()[0]["version"] == 4
        check_verified(steps, cfg)
    finally:
        r.close()
