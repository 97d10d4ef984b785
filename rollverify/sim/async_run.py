"""The asynchronous schedule in `rollverify simulate`: the real `AsyncLoop` on a disaggregated simulated cluster.

The cluster's GPUs split into rollout servers (`rollout_gpus / tp` of them) and the trainer (the rest). The
engines advance the run's clock; the trainer has a clock of its own (`SimCalls`): a call the loop starts runs
there at once and completes on the run's clock when the trainer, busy with one call at a time, would have
finished it, while the engines go on generating up to that moment (`SimEngine.horizon`). A trainer call the loop
makes directly (a fallback's) blocks the run's clock, as it blocks the driver.

Modes: `async_rollverify` (every trained token verified against its step's policy, `algo.max_staleness` as the
backstop) and `async_partial`, the unverified asynchronous baseline. Both are one-step-off: new groups launch
only while fewer than `algo.queue_groups` (default B: one batch) finished groups wait for the trainer, as AReaL's
staleness control admits new rollouts, and both restart a response past the same backstop bound; they differ in
verification only (the baseline's loss-side correction costs no GPU time here).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from rollverify.async_loop import AsyncLoop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.sim.cost import CostModel
from rollverify.sim.engine import DriftClock, SimClock, SimEngine, SimTrainer
from rollverify.types import Group

ASYNC_MODES = ("async_rollverify", "async_partial", "async_rollverify_tb")  # _tb: its on-policy fallback tail-batched


class _SimPending:
    def __init__(self, calls: SimCalls, result: Any, end: float) -> None:
        self.calls, self._result, self.end = calls, result, end

    def done(self) -> bool:
        return self.calls.clock.now >= self.end - 1e-9

    def wait(self, timeout: float) -> None:
        """The engines have nothing to generate: the run's clock jumps to the trainer's answer (idle servers)."""
        if not self.done():
            self.calls.clock.advance(self.end - self.calls.clock.now, "idle")

    def result(self) -> Any:
        self.calls.engine.horizon = math.inf
        return self._result


class SimCalls:
    """`rollverify.async_loop.Calls` on the simulated trainer's own GPUs (see the module docstring)."""

    def __init__(self, clock: SimClock, engine: SimEngine, trainer: SimTrainer) -> None:
        self.clock, self.engine, self.trainer = clock, engine, trainer
        self.trainer_clock = SimClock()
        self.free_at = 0.0  # the run's time at which the trainer finishes its last call
        self.busy_s = 0.0

    def start(self, fn, *args, **kwargs) -> _SimPending:
        self.trainer.clock = self.trainer_clock
        t0 = self.trainer_clock.now
        try:
            result = fn(*args, **kwargs)
        finally:
            self.trainer.clock = self.clock
        took = self.trainer_clock.now - t0
        self.busy_s += took
        end = self.free_at = max(self.clock.now, self.free_at) + took
        self.engine.horizon = end
        return _SimPending(self, result, end)

    def close(self) -> None:
        pass


def simulate_async(mode: str, context: int, cfg: Any, rollout_gpus: int,
                   abort_above_s: float = math.inf) -> dict[str, Any] | None:
    """Run `AsyncLoop` for `cfg.steps` steps of `mode` with `rollout_gpus` of `cfg.cluster.gpus` serving
    rollouts; returns the run's figures (`rollverify.sim.run.RunResult`'s fields and the split's), or None as
    soon as its steps after the first have taken more than `abort_above_s` simulated seconds (a split search's
    bound: it can no longer beat the best split so far)."""
    if mode not in ASYNC_MODES:
        raise ValueError(f"mode must be one of {ASYNC_MODES}, got {mode!r}")
    cluster = cfg.cluster
    trainer_gpus = cluster.gpus - rollout_gpus
    if not 0 < rollout_gpus < cluster.gpus or rollout_gpus % cluster.tp:
        raise ValueError(f"rollout_gpus must be a multiple of tp ({cluster.tp}) in (0, {cluster.gpus}), got "
                         f"{rollout_gpus}")
    workload = replace(cfg.workload, context=context)
    # the pause of a publish: the weight broadcast plus pause / commit / resume (no memory hand-over)
    cost_r = CostModel(cfg.model, replace(cluster, gpus=rollout_gpus, sync_overhead_s=cfg.async_pause_s,
                                          resident_gib=cfg.async_resident_gib))
    cost_t = CostModel(cfg.model, replace(cluster, gpus=trainer_gpus))
    clock = SimClock()
    drift_clock = DriftClock(cfg.drift, cfg.steps)
    engine = SimEngine(cost_r, workload, clock, cfg.seed, drift=cfg.drift, drift_clock=drift_clock)
    trainer = SimTrainer(cost_t, cfg.drift, clock, workload.token_unit, cfg.steps, cfg.seed, drift_clock=drift_clock)
    trainer.step_overhead_s = cfg.async_trainer_overhead_s
    calls = SimCalls(clock, engine, trainer)
    batch = cfg.batch_groups * cfg.n
    rollout = RolloutConfig(
        batch_groups=cfg.batch_groups, n=cfg.n, max_new_tokens=workload.max_units, temperature=1.0,
        max_live=max(batch, int(cfg.max_live_batches * batch)), wait_s=0.0, phase_timeout_s=3600.0,
    )
    window = max(2, round(cfg.algo.switch_window * cfg.steps / cfg.paper_steps))
    inner = mode.removeprefix("async_").removesuffix("_tb")
    staleness = cfg.algo.max_staleness
    algo = replace(cfg.algo, mode=inner, schedule="async", switch_window=window, monitor_ops=False,
                   tail_batching=mode.endswith("_tb"))
    prompt = np.zeros(workload.prompt_tokens, np.int32)
    loop = AsyncLoop(algo, Rollout(rollout, engine, trainer, lambda gid: Group.new(gid, prompt, cfg.n, workload.max_units),
                                   lambda group, response: float(response.index % 2)), calls=calls)
    steps, accept, switched_at, stale, returned, again, idle = [], [], None, [], 0, 0, []
    for _ in range(cfg.steps):
        t0, idle0 = clock.now, clock.spent.get("idle", 0.0)
        m = loop.run_step().metrics
        steps.append(clock.now - t0)
        idle.append(clock.spent.get("idle", 0.0) - idle0)
        if m.get("verified_tokens", 0) > 0 and math.isfinite(m.get("acceptance_rate", math.nan)):
            accept.append(m["acceptance_rate"])
        if m.get("switched") and switched_at is None:
            switched_at = len(steps)
        stale.append(m.get("trained_staleness_max") or 0)  # None on a step of the fallback loop
        returned += int(m.get("n_returned_groups") or 0)
        again += int(m.get("n_returned_again") or 0)
        if sum(steps[1:]) > abort_above_s:
            return None
    # the first step fills the pipeline (every group starts then): the steady state is the mean of the others
    step_s = float(np.mean(steps[1:] if len(steps) > 1 else steps))
    ledger = loop.ledger
    rollout_server_s = clock.spent.get("rollout", 0.0) * cost_r.cluster.servers
    return dict(
        mode=mode, verify_on=algo.verify_on, context=context, steps=cfg.steps,
        gpu_days=step_s * cfg.paper_steps * cluster.gpus / 86400.0, step_s_mean=step_s,
        phase_s={k: v / cfg.steps for k, v in clock.spent.items()},
        tokens_per_step=ledger.generated_tokens * workload.token_unit / cfg.steps,
        cut_fraction=ledger.cut_tokens / max(ledger.generated_tokens, 1),
        acceptance_mean=float(np.mean(accept)) if accept else math.nan,
        acceptance_by_step=[round(a, 4) for a in accept], switched_at=switched_at,
        prefill_share=(engine.prefill_s + engine.verify_prefill_s) / rollout_server_s if rollout_server_s else 0.0,
        verify_share=0.0, on_policy_longest_share=math.nan,
        rollout_gpus=rollout_gpus, trainer_gpus=trainer_gpus, max_staleness=staleness,
        trainer_busy_share=calls.busy_s / clock.now, rollout_idle_share=float(np.sum(idle)) / clock.now,
        first_step_s=steps[0], trained_staleness_max=int(max(stale)), returned_groups=returned,
        returned_again=again,
        step_s_by_step=[round(x, 2) for x in steps],
        **engine.kv_figures(cfg.steps), offpolicy_share=trainer.offpolicy_share(),
        gpu_days_before_switch=float(np.mean(steps[1:switched_at - 1] if switched_at and switched_at > 2 else steps[1:]))
        * cfg.paper_steps * cluster.gpus / 86400.0,
    )
