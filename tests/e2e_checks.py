"""What the end-to-end tests share: a reward that varies with the response, the float32 engine/trainer agreement
floor, and the watch on an asynchronous run's trainer (tests/test_async_e2e.py, test_replay_resume.py,
test_ray_cluster.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from rollverify.app.train import Run
from rollverify.verify import two_stage_verify

# `task.reward` for a model that is not warm-started, where the task's own reward would be 0 everywhere and no
# step would change the weights
REWARD = f"{Path(__file__).with_name('replay_reward.py')}:score"
# float32 engine and trainer agree to ~2e-6 per token (kernels' rounding); stale routes gave 1e-2 .. 2e-1
FLOOR = 1e-5


def watch_trainer(r: Run) -> list[dict]:
    """Wrap the run's trainer: each train_step records what it was handed and what the trainer computes."""
    trainer, engine = r.trainer, r.engine
    steps: list[dict] = []
    train_step, own_old, wait_finished = trainer.train_step, trainer.old_logprobs, engine.wait_finished
    polled = threading.Event()

    def counted(timeout: float):  # the driver polls the engines
        polled.set()
        return wait_finished(timeout)

    engine.wait_finished = counted

    def recorded(responses, advantages, temperature, policy_version, old_logprobs=None):
        own = own_old(responses, temperature)
        generated = r.loop.ledger.generated_tokens
        polled.clear()
        out = train_step(responses, advantages, temperature, policy_version, old_logprobs=old_logprobs)
        # the call returns only once the driver polled the engines after it began: a driver that waited for the
        # trainer instead would never poll meanwhile, and the wait would end at its limit
        polled_meanwhile = polled.wait(120.0)
        steps.append({
            "thread": threading.current_thread().name, "version": policy_version, "own": own, "old": old_logprobs,
            "tokens": [(x.logprobs.copy(), x.versions.copy()) for x in responses],
            "groups": {x.group_id for x in responses},
            "generated_meanwhile": r.loop.ledger.generated_tokens - generated, "polled_meanwhile": polled_meanwhile,
        })
        return out

    trainer.train_step = recorded
    return steps


def check_verified(steps: list[dict], cfg) -> None:
    for s in steps:
        assert s["thread"].startswith("rollverify-trainer")  # off the driver, which fed the engines meanwhile
        for (lp, ver), old, own in zip(s["tokens"], s["old"], s["own"], strict=True):
            np.testing.assert_allclose(old, own, rtol=0, atol=1e-6)  # verified with the step's own old log-probs
            assert s["version"] - ver.min() <= cfg.algo.max_staleness
            keep = two_stage_verify(old, lp, ver, np.array([len(lp)]), cfg.algo.d_s, cfg.algo.d_t).keep_lengths
            assert int(keep[0]) == len(lp)
