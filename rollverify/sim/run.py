"""`rollverify simulate`: GPU-days of on_policy, partial and rollverify (and the asynchronous schedule) against
the context limit, from the real loops over the simulated engine and trainer, compared with the paper's Table 7,
beside the workload's physical floor (`rollverify.sim.floor`) and again under other drifts
(`rollverify.sim.sensitivity`); simulate.json labels every input as measured or guessed
(`rollverify.sim.inputs`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from rollverify.loop import Loop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.sim import cost as sim_cost
from rollverify.sim import sensitivity
from rollverify.sim.async_run import ASYNC_MODES, simulate_async
from rollverify.sim.cost import GPUS, ClusterSpec, CostModel, ModelSpec
from rollverify.sim.engine import DriftClock, DriftModel, SimClock, SimEngine, SimTrainer, ToolModel, Workload
from rollverify.sim.floor import FLOORS, FloorSpec, floors
from rollverify.sim.inputs import inputs
from rollverify.sim.sensitivity import DEFAULT_VARIANTS, DRIFT_MODES, PAPER_TABLE7
from rollverify.strategies import VERIFY_ON, AlgoConfig
from rollverify.types import Group

MODES = ("on_policy", "partial", "rollverify")  # the alternating loop, colocated (the default run)
# on-policy tail batching (`algo.tail_batching`): on_policy with it, and rollverify whose switch falls to it
TAIL_MODES = ("on_policy_tb", "rollverify_tb")
ALL_MODES = (*MODES, *TAIL_MODES, *ASYNC_MODES)  # and the asynchronous schedule, disaggregated (rollverify.sim.async_run)
CONTEXTS = (8192, 16384, 32768, 65536)
SECONDS_PER_DAY = 86400.0
VERIFY_WHERE = {
    "trainer": "verification on the trainer: a forward (2N per token and causal attention) over the carried responses",
    "engine": "verification on the engines: they prefill the carried responses under the new weights while the new "
              "groups run (no trainer forward) and the resumed prefixes reuse that KV",
}


@dataclass
class SimConfig:
    """One parameter set for every context limit (only ``workload.context`` changes between them)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    workload: Workload = field(default_factory=Workload)
    drift: DriftModel = field(default_factory=DriftModel)
    tools: ToolModel = field(default_factory=ToolModel)  # tool calls per trajectory and their latency
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    batch_groups: int = 128
    n: int = 8
    max_live_batches: float = 1.0  # responses in flight in the carry-over modes, in batches of batch_groups x n
    steps: int = 20  # simulated optimizer steps standing for paper_steps; drift progress is step / steps
    paper_steps: int = 500  # GPU-days are for this many steps (mean simulated step time x paper_steps)
    seed: int = 0
    # --- the asynchronous schedule (disaggregated) ---
    rollout_gpus: int = 0  # GPUs of the servers (the rest train); 0: the best of `split_candidates`
    split_candidates: tuple[int, ...] = ()  # empty: every split (every multiple of tp that leaves the trainer a GPU)
    async_pause_s: float = 3.0  # per publish besides the weight broadcast: pause, commit, resume
    async_trainer_overhead_s: float = 5.0  # per step on the trainer besides its passes: rewards, data, the step's launch
    async_resident_gib: float = 1.5  # memory in use on a server's GPU before its weights load: its own CUDA context
    # --- what every table is held against ---
    drift_variants: tuple[tuple[str, float], ...] = DEFAULT_VARIANTS  # (driver, late) besides `drift`
    floors: tuple[FloorSpec, ...] = FLOORS


@dataclass
class RunResult:
    mode: str
    verify_on: str  # where the new log-probs come from: "trainer" (a forward) or "engine" (a prefill)
    context: int
    steps: int
    gpu_days: float
    step_s_mean: float
    phase_s: dict[str, float]  # mean seconds per step in each phase
    tokens_per_step: float  # generated real tokens per step
    cut_fraction: float  # generated tokens later cut by verification
    acceptance_mean: float
    acceptance_by_step: list[float]
    switched_at: int | None
    prefill_share: float  # of the rollout server-time: admissions' and (engine) the verification's prefill
    verify_share: float  # of the step: the trainer's verification forward (engine: none, its prefill is rollout)
    on_policy_longest_share: float  # on_policy: rollout time / time to decode the longest response alone
    tool_calls_per_step: float = 0.0  # tool calls made per step (ToolModel)
    tool_s_per_step: float = 0.0  # their latency summed
    tool_idle_share: float = 0.0  # of the rollout time: every live sequence waited on a call
    # --- each server's KV pool (SimEngine.kv_figures) and what training consumed ---
    kv_capacity_tokens: float = 0.0  # per server, as SGLang sizes it (0: unlimited)
    mem_fraction_static: float = math.nan
    kv_peak_share: float = 0.0  # the most of a server's pool its running sequences held
    retractions_per_step: float = 0.0  # sequences retracted because a server's pool was full
    retracted_tokens_per_step: float = 0.0  # their KV freed, prefilled again when re-admitted
    retract_prefill_share: float = 0.0  # of the rollout server-time: those prefills
    queued_per_step_s: float = 0.0  # request-seconds per step spent waiting for room in a server's queue
    offpolicy_share: float = 0.0  # of the generated tokens trained: sampled by an older version than the step's
    # --- the asynchronous schedule only ---
    rollout_gpus: int = 0  # GPUs serving rollouts (0: colocated, all of them take turns)
    trainer_gpus: int = 0
    max_staleness: int = 0  # the staleness bound it ran with
    trainer_busy_share: float = math.nan  # of the run: the trainer's GPUs working
    rollout_idle_share: float = math.nan  # of the run: the servers with nothing to generate
    first_step_s: float = math.nan  # the pipeline's fill (left out of step_s_mean)
    trained_staleness_max: int = 0
    returned_groups: int = 0  # groups a step's verification sent back
    returned_again: int = 0  # of them, groups sent back before (verified again staler: the ratchet)
    split_search: dict[str, float] = field(default_factory=dict)  # rollout GPUs -> GPU-days, when searched
    split_pruned: list[str] = field(default_factory=list)  # splits stopped once they could no longer win: their
    # split_search figure is a lower bound (the GPU-days of the steps they ran, spread over the whole run)
    step_s_by_step: list[float] = field(default_factory=list)
    # GPU-days at the mean step before the switch (async: the pipeline's fill left out too): what the schedule
    # costs while acceptance holds (the drift's collapse comes at the same share of the run whatever `steps` is)
    gpu_days_before_switch: float = math.nan
    long_rounds: int = 0  # tail batching: steps that generated only deferred prompts

    def row(self) -> dict:
        return asdict(self)


def simulate(mode: str, context: int, cfg: SimConfig) -> RunResult:
    """Run the real loop for ``cfg.steps`` steps of ``mode`` at this context limit on simulated time."""
    workload = replace(cfg.workload, context=context)
    cost = CostModel(cfg.model, cfg.cluster)
    clock = SimClock()
    drift_clock = DriftClock(cfg.drift, cfg.steps)
    engine = SimEngine(cost, workload, clock, cfg.seed, drift=cfg.drift, tools=cfg.tools, drift_clock=drift_clock)
    trainer = SimTrainer(cost, cfg.drift, clock, workload.token_unit, cfg.steps, cfg.seed, drift_clock=drift_clock)
    batch = cfg.batch_groups * cfg.n
    tail = mode in TAIL_MODES
    # on_policy_tb's regular round launches tail_launch batches at once; rollverify_tb keeps rollverify's
    # carry-over concurrency, so the two differ only after the switch (its regular rounds launch as room frees)
    on_tb = mode == "on_policy_tb"
    max_live = max(batch, int(cfg.max_live_batches * batch), math.ceil(cfg.algo.tail_launch * batch) if on_tb else 0)
    rollout = RolloutConfig(
        batch_groups=cfg.batch_groups, n=cfg.n, max_new_tokens=workload.max_units, temperature=1.0,
        max_live=max_live, wait_s=0.0, phase_timeout_s=3600.0,
    )
    prompt = np.zeros(workload.prompt_tokens, np.int32)
    # the switch window covers the same share of training as in a run of paper_steps steps (at least 2 steps)
    window = max(2, round(cfg.algo.switch_window * cfg.steps / cfg.paper_steps))
    loop = Loop(
        # partial pays no verification forward: no monitoring OPS either
        replace(cfg.algo, mode=mode.removesuffix("_tb"), tail_batching=tail, switch_window=window, monitor_ops=False),
        Rollout(rollout, engine, trainer, make_group=lambda gid: Group.new(gid, prompt, cfg.n, workload.max_units),
                reward=lambda group, response: float(response.index % 2)),
    )
    steps, phases, accept, switched_at, longest, long_rounds = [], [], [], None, [], 0
    for _ in range(cfg.steps):
        t0, spent0 = clock.now, dict(clock.spent)
        result = loop.run_step()
        m = result.metrics
        steps.append(clock.now - t0)
        phases.append({k: v - spent0.get(k, 0.0) for k, v in clock.spent.items()})
        if math.isfinite(m.get("acceptance_rate", math.nan)) and m.get("verified_tokens", 0) > 0:
            accept.append(m["acceptance_rate"])
        if m.get("switched") and switched_at is None:
            switched_at = len(steps)
        long_rounds += int(m.get("tail/long_round") or 0)
        if mode == "on_policy" and result.trained_groups:
            longest_units = max(r.num_tokens for g in result.trained_groups for r in g.responses)
            longest.append(phases[-1].get("rollout", 0.0) / _alone(cost, workload, longest_units))
    step_s = float(np.mean(steps))
    names = sorted({k for p in phases for k in p})
    ledger = loop.ledger
    rollout_server_s = clock.spent.get("rollout", 0.0) * cost.cluster.servers
    return RunResult(
        mode=mode, verify_on=cfg.algo.verify_on, context=context, steps=cfg.steps,
        gpu_days=step_s * cfg.paper_steps * cfg.cluster.gpus / SECONDS_PER_DAY,
        step_s_mean=step_s,
        phase_s={k: float(np.mean([p.get(k, 0.0) for p in phases])) for k in names},
        tokens_per_step=ledger.generated_tokens * workload.token_unit / cfg.steps,
        cut_fraction=ledger.cut_tokens / max(ledger.generated_tokens, 1),
        acceptance_mean=float(np.mean(accept)) if accept else math.nan,
        acceptance_by_step=[round(a, 4) for a in accept],
        switched_at=switched_at,
        prefill_share=(engine.prefill_s + engine.verify_prefill_s) / rollout_server_s if rollout_server_s else 0.0,
        verify_share=clock.spent.get("verify", 0.0) / clock.now,
        on_policy_longest_share=float(np.mean(longest)) if longest else math.nan,
        tool_calls_per_step=engine.tool_calls / cfg.steps,
        tool_s_per_step=engine.tool_s / cfg.steps,
        tool_idle_share=engine.tool_idle_s / clock.spent["rollout"] if clock.spent.get("rollout") else 0.0,
        **engine.kv_figures(cfg.steps), offpolicy_share=trainer.offpolicy_share(),
        step_s_by_step=[round(x, 2) for x in steps],
        gpu_days_before_switch=float(np.mean(steps[:switched_at - 1] if switched_at and switched_at > 1 else steps))
        * cfg.paper_steps * cfg.cluster.gpus / SECONDS_PER_DAY,
        long_rounds=long_rounds,
    )


def _alone(cost: CostModel, workload: Workload, units: int) -> float:
    """Seconds to decode a response of ``units`` alone on one server (a lower bound of on_policy's rollout)."""
    longest = units * workload.token_unit
    ctx = workload.prompt_tokens + np.arange(0, longest, workload.token_unit) + workload.token_unit / 2
    return float(np.sum(cost.decode_iteration(1.0, ctx)) * workload.token_unit) or math.nan


def splits(cfg: SimConfig) -> list[int]:
    """The rollout-GPU counts a split search tries: `cfg.split_candidates`, or every multiple of tp that leaves the
    trainer at least one GPU."""
    if cfg.split_candidates:
        return list(cfg.split_candidates)
    tp = cfg.cluster.tp
    return list(range(tp, cfg.cluster.gpus, tp))


def simulate_split(mode: str, context: int, cfg: SimConfig, log=print, hint: int | None = None) -> RunResult:
    """An asynchronous mode on `cfg.rollout_gpus` server GPUs, or on the best of every split (`splits`). The search
    starts at `hint` (else 65 % of the GPUs) and goes outward from it; a split stops as soon as the steps it has run
    already cost more than the best so far over the whole run (it can no longer win, and every step costs more
    than nothing), so every split is tried and only the contenders run to the end."""
    if cfg.rollout_gpus:
        return RunResult(**simulate_async(mode, context, cfg, cfg.rollout_gpus))
    candidates = splits(cfg)
    start = hint if hint in candidates else min(candidates, key=lambda g: abs(g - 0.65 * cfg.cluster.gpus))
    order = sorted(candidates, key=lambda g: (abs(g - start), g))
    runs: dict[int, RunResult] = {}
    search: dict[str, float] = {}
    pruned: list[str] = []
    best: RunResult | None = None
    per_day = cfg.paper_steps * cfg.cluster.gpus / SECONDS_PER_DAY
    for g in order:
        bound = best.step_s_mean * (cfg.steps - 1) if best is not None and cfg.steps > 1 else math.inf
        out = simulate_async(mode, context, cfg, g, abort_above_s=bound)
        if out is None:  # its steps after the first already cost more than the best's: at least the best's GPU-days
            search[str(g)] = bound / (cfg.steps - 1) * per_day
            pruned.append(str(g))
            log(f"       {mode} {g} rollout / {cfg.cluster.gpus - g} trainer GPUs: > {search[str(g)]:.1f} GPU-days "
                "(stopped)")
            continue
        runs[g] = RunResult(**out)
        search[str(g)] = runs[g].gpu_days
        log(f"       {mode} {g} rollout / {cfg.cluster.gpus - g} trainer GPUs: {runs[g].gpu_days:.1f} GPU-days")
        if best is None or runs[g].gpu_days < best.gpu_days:
            best = runs[g]
    assert best is not None
    best.split_search = {k: search[k] for k in sorted(search, key=int)}
    best.split_pruned = sorted(pruned, key=int)
    return best


def _log_run(log, context: int, mode: str, r: RunResult, took: float, label: str = "") -> None:
    split = f"  {r.rollout_gpus} rollout GPUs, staleness <= {r.trained_staleness_max}" if r.rollout_gpus else ""
    kv = (f"  KV {r.kv_capacity_tokens / 1e3:.0f}K/server peak {r.kv_peak_share:.0%}, "
          f"{r.retractions_per_step:.1f} retractions/step" if r.kv_capacity_tokens else "")
    log(f"  {context // 1024:>3}K {mode:<16}{label} {r.gpu_days:8.1f} GPU-days  step {r.step_s_mean:7.1f} s  "
        f"verify {r.verify_share:5.1%} of it  acceptance {r.acceptance_mean:.3f}  switched at {r.switched_at}"
        + split + kv
        + (f"  tools {r.tool_calls_per_step:.0f} calls {r.tool_s_per_step:.0f} s/step, all waiting "
           f"{r.tool_idle_share:.1%} of rollout" if r.tool_calls_per_step else "")
        + f"  ({took:.1f} s to simulate)")


def run_all(cfg: SimConfig, contexts=CONTEXTS, modes=MODES, log=print, sensitivity_runs: bool = True) -> dict:
    """Every mode at every context limit, the floors of each workload, and (``sensitivity_runs``) the drift-dependent
    modes again under each of `cfg.drift_variants`."""
    results: dict[int, dict[str, RunResult]] = {}
    floor_rows: dict[int, list[dict]] = {}
    sens: dict[str, dict[str, dict]] = {}
    hints: dict[str, int] = {}
    drifts = sensitivity.variants(cfg.drift, cfg.drift_variants if sensitivity_runs else ())
    for context in contexts:
        results[context] = {}
        for mode in modes:
            start = time.perf_counter()
            if mode in ASYNC_MODES:
                r = simulate_split(mode, context, cfg, log, hint=hints.get(mode))
                hints[mode] = r.rollout_gpus
            else:
                r = simulate(mode, context, cfg)
            results[context][mode] = r
            _log_run(log, context, mode, r, time.perf_counter() - start)
        workload = replace(cfg.workload, context=context)
        floor_rows[context] = floors(cfg.model, GPUS[cfg.cluster.gpu], cfg.cluster.gpus, workload, cfg.seed,
                                     cfg.batch_groups, cfg.n, cfg.steps, cfg.paper_steps, cfg.floors)
        by_drift: dict[str, dict] = {}
        for drift in drifts:
            by_mode = {m: r.row() for m, r in results[context].items()}
            if drift != cfg.drift:
                for mode in (m for m in modes if m in DRIFT_MODES):
                    start = time.perf_counter()
                    vcfg = replace(cfg, drift=drift)
                    if mode in ASYNC_MODES:
                        vcfg = replace(vcfg, rollout_gpus=results[context][mode].rollout_gpus)
                        r = RunResult(**simulate_async(mode, context, vcfg, vcfg.rollout_gpus))
                    else:
                        r = simulate(mode, context, vcfg)
                    by_mode[mode] = r.row()
                    _log_run(log, context, mode, r, time.perf_counter() - start, f" [{drift.label()}]")
            by_drift[drift.label()] = sensitivity.ratios(by_mode, floor_rows[context])
        sens[str(context)] = by_drift
    report = {"config": _config_dict(cfg), "results": results, "floors": {str(c): f for c, f in floor_rows.items()},
              "comparison": compare(results, floor_rows)}
    if len(drifts) > 1:
        report["sensitivity"] = sens
        report["conclusions"] = sensitivity.conclusions(sens)
    report["drift_per_version"] = drift_per_version(cfg.drift)
    report["inputs"] = inputs(report["config"])
    report["guessed_inputs"] = [row["key"] for row in report["inputs"] if row["guessed"]]
    return report


def drift_per_version(drift: DriftModel) -> dict:
    """The model's mean OPS of a token one version old where the run stands at x (progress or off-policy
    training; `DriftModel`), and two and four versions old at the collapse point."""
    points = sorted({0.1, 0.3, 0.5, 0.7, round(drift.late - 0.1, 3), drift.late, round(drift.late + 0.05, 3)})
    return dict(driver=drift.driver, late=drift.late,
                ops_one_version={str(x): drift.ops_per_version(x) for x in points},
                ops_at_late={str(k): drift.ops_per_version(drift.late, k) for k in (1, 2, 4)})


def compare(results: dict[int, dict[str, RunResult]], floor_rows: dict[int, list[dict]] | None = None) -> list[dict]:
    rows = []
    for context, by_mode in results.items():
        base = by_mode.get("on_policy")
        row: dict = {"context": context}
        for mode, r in by_mode.items():
            row[f"{mode}_gpu_days"] = r.gpu_days
            if base is not None:
                row[f"{mode}_ratio"] = r.gpu_days / base.gpu_days
        for f in (floor_rows or {}).get(context, []):
            row[f"{f['name']}_gpu_days"] = f["gpu_days"]
            if base is not None:
                row[f"{f['name']}_ratio"] = f["gpu_days"] / base.gpu_days
        if context in PAPER_TABLE7:
            on, rv = PAPER_TABLE7[context]
            row.update(paper_on_policy_gpu_days=on, paper_rollverify_gpu_days=rv, paper_ratio=rv / on)
            if "rollverify_ratio" in row:
                row["ratio_error"] = row["rollverify_ratio"] / (rv / on) - 1
                row["within_15pct"] = abs(row["ratio_error"]) <= 0.15
        rows.append(row)
    return rows


def _floor_cells(r: dict, specs: tuple[FloorSpec, ...]) -> str:
    """Each floor's GPU-days and (its ratio to on_policy)."""
    cells = []
    for spec in specs:
        days, ratio = r.get(f"{spec.name}_gpu_days"), r.get(f"{spec.name}_ratio")
        cells.append("-" if days is None else f"{days:.1f}" + (f" ({ratio:.2f})" if ratio is not None else ""))
    return "".join(f"{c:>15}" for c in cells)


def _floor_heads(specs: tuple[FloorSpec, ...]) -> str:
    return "".join(f"{f'floor {s.bw_fraction:.0%}/{s.mfu:g}':>15}" for s in specs)


def table(rows: list[dict], specs: tuple[FloorSpec, ...] = FLOORS) -> str:
    head = (f"{'context':>8}{'on_policy':>11}{'partial':>10}{'rollverify':>11}{'partial/on':>11}{'rv/on':>8}"
            f"{'paper rv/on':>13}{'error':>8}" + _floor_heads(specs) + "  paper GPU-days (on -> rv)")
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"
        paper = f"{r['paper_on_policy_gpu_days']:.1f} -> {r['paper_rollverify_gpu_days']:.1f}" if "paper_ratio" in r else ""
        err = f"{r['ratio_error']:+.1%}" if "ratio_error" in r else "-"
        lines.append(
            f"{r['context'] // 1024:>7}K{f('on_policy_gpu_days', '.1f'):>11}{f('partial_gpu_days', '.1f'):>10}"
            f"{f('rollverify_gpu_days', '.1f'):>11}{f('partial_ratio', '.3f'):>11}{f('rollverify_ratio', '.3f'):>8}"
            f"{f('paper_ratio', '.3f'):>13}{err:>8}" + _floor_cells(r, specs) + f"  {paper}"
        )
    return "\n".join(lines)


def async_table(rows: list[dict], specs: tuple[FloorSpec, ...] = FLOORS) -> str:
    """The asynchronous schedule's GPU-days and ratios to on_policy (and to colocated rollverify)."""
    head = (f"{'context':>8}{'on_policy':>11}{'rollverify':>11}{'async_rv':>10}{'async_partial':>15}{'rv/on':>8}"
            f"{'async_rv/on':>13}{'async_partial/on':>18}{'async_rv/rv':>13}" + _floor_heads(specs))
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"
        rv = (f"{r['async_rollverify_gpu_days'] / r['rollverify_gpu_days']:.3f}"
              if "async_rollverify_gpu_days" in r and "rollverify_gpu_days" in r else "-")
        lines.append(
            f"{r['context'] // 1024:>7}K{f('on_policy_gpu_days', '.1f'):>11}{f('rollverify_gpu_days', '.1f'):>11}"
            f"{f('async_rollverify_gpu_days', '.1f'):>10}{f('async_partial_gpu_days', '.1f'):>15}"
            f"{f('rollverify_ratio', '.3f'):>8}{f('async_rollverify_ratio', '.3f'):>13}"
            f"{f('async_partial_ratio', '.3f'):>18}{rv:>13}" + _floor_cells(r, specs)
        )
    return "\n".join(lines)


def tail_table(rows: list[dict], results: dict[int, dict[str, RunResult]],
               specs: tuple[FloorSpec, ...] = FLOORS) -> str:
    """On-policy tail batching beside on_policy and rollverify (its fallback tail-batched or not), with the floors."""
    head = (f"{'context':>8}{'on_policy':>11}{'on_tb':>9}{'on_tb/on':>10}{'long rounds':>13}{'rv':>8}{'rv_tb':>8}"
            f"{'rv/on':>8}{'rv_tb/on':>10}{'switch':>8}" + _floor_heads(specs))
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"
        tb = results.get(r["context"], {})
        long = str(tb["on_policy_tb"].long_rounds) if "on_policy_tb" in tb else "-"
        switch = str(tb["rollverify_tb"].switched_at) if "rollverify_tb" in tb else "-"
        lines.append(
            f"{r['context'] // 1024:>7}K{f('on_policy_gpu_days', '.1f'):>11}{f('on_policy_tb_gpu_days', '.1f'):>9}"
            f"{f('on_policy_tb_ratio', '.3f'):>10}{long:>13}{f('rollverify_gpu_days', '.1f'):>8}"
            f"{f('rollverify_tb_gpu_days', '.1f'):>8}{f('rollverify_ratio', '.3f'):>8}{f('rollverify_tb_ratio', '.3f'):>10}"
            f"{switch:>8}" + _floor_cells(r, specs))
    return "\n".join(lines)


def floor_notes(specs: tuple[FloorSpec, ...]) -> str:
    """What the floor columns assume (they are the physical floor of the same workload; ratios to on_policy)."""
    return "\n".join(f"floor {s.bw_fraction:.0%}/{s.mfu:g}: {s.assumptions}" for s in specs)


def kv_table(results: dict[str, dict[str, dict]]) -> str:
    """Each run's KV pool: capacity per server, the peak held, retractions and their prefill, queueing."""
    head = (f"{'context':>8} {'mode':<17}{'KV/server':>11}{'mem_frac':>9}{'peak':>7}{'retract/step':>14}"
            f"{'re-prefill':>12}{'queued req-s/step':>19}{'off-policy':>12}")
    lines = [head, "-" * len(head)]
    for context, by_mode in results.items():
        for mode, r in by_mode.items():
            cap = f"{r['kv_capacity_tokens'] / 1e3:.0f}K" if r["kv_capacity_tokens"] else "inf"
            lines.append(f"{int(context) // 1024:>7}K {mode:<17}{cap:>11}{r['mem_fraction_static']:>9.3f}"
                         f"{r['kv_peak_share']:>7.0%}{r['retractions_per_step']:>14.1f}"
                         f"{r['retract_prefill_share']:>12.1%}{r['queued_per_step_s']:>19.0f}"
                         f"{r['offpolicy_share']:>12.1%}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["comparison"]
    ks = [r["context"] // 1024 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("on_policy", "o-"), ("partial", "s--"), ("rollverify", "^-")):
        if f"{mode}_gpu_days" in rows[0]:
            a.plot(ks, [r[f"{mode}_gpu_days"] for r in rows], style, label=f"{mode} (model)")
            if mode != "on_policy":
                b.plot(ks, [r[f"{mode}_ratio"] for r in rows], style, label=f"{mode} / on_policy (model)")
    paper = [r for r in rows if "paper_ratio" in r]
    a.plot([r["context"] // 1024 for r in paper], [r["paper_on_policy_gpu_days"] for r in paper], "kx",
           label="on_policy (paper)")
    a.plot([r["context"] // 1024 for r in paper], [r["paper_rollverify_gpu_days"] for r in paper], "r+",
           markersize=10, label="rollverify (paper)")
    pk = [r["context"] // 1024 for r in paper]
    pr = np.array([r["paper_ratio"] for r in paper])
    b.errorbar(pk, pr, yerr=0.15 * pr, fmt="r+", markersize=10, capsize=4, label="rollverify / on_policy (paper, ±15 %)")
    for name, style in zip([k.removesuffix("_ratio") for k in rows[0] if k.startswith("floor_") and k.endswith("_ratio")],
                           ("v:", "D-."), strict=False):
        a.plot(ks, [r[f"{name}_gpu_days"] for r in rows], style, color="k", label=f"{name} (physical floor)")
        b.plot(ks, [r[f"{name}_ratio"] for r in rows], style, color="k", label=f"{name} / on_policy")
    sens = report.get("sensitivity", {})
    if sens and all("rollverify_ratio" in row for by in sens.values() for row in by.values()):
        lo = [min(row["rollverify_ratio"] for row in sens[str(r["context"])].values()) for r in rows]
        hi = [max(row["rollverify_ratio"] for row in sens[str(r["context"])].values()) for r in rows]
        b.fill_between(ks, lo, hi, color="C2", alpha=0.2, label="rollverify / on_policy over the drift range")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [f"{k}K" for k in ks])
        ax.set_xlabel("max context")
        ax.legend(fontsize=8)
    a.set_ylabel("GPU-days")
    b.set_ylabel("GPU-days / on_policy")
    b.set_ylim(0, 1.1)
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']['name']} on {cfg['cluster']['gpus']} {cfg['cluster']['gpu']}, batch "
                 f"{cfg['batch_groups']}x{cfg['n']}: simulated ({cfg['steps']} steps) vs the paper's Table 7")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _config_dict(cfg: SimConfig) -> dict:
    d = asdict(cfg)
    d["gpu_spec"] = asdict(GPUS[cfg.cluster.gpu])
    d["floors"] = {s.name: asdict(s) for s in cfg.floors}
    d["drift_variants"] = [f"{driver}:{late:g}" for driver, late in cfg.drift_variants]
    d["sglang"] = {name.removeprefix("SGLANG_").lower(): getattr(sim_cost, name) for name in dir(sim_cost)
                   if name.startswith("SGLANG_")}
    d["poll_s"] = 1.0  # SimEngine's default: how often the loop sees finishes
    return d


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollverify simulate", description=__doc__)
    p.add_argument("--out", default="runs/simulate", help="folder for simulate.json and simulate.png")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="context limits in tokens")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES,
                   help="async_rollverify / async_partial: the asynchronous schedule, disaggregated")
    p.add_argument("--rollout-gpus", type=int, default=0,
                   help="asynchronous modes: GPUs of the servers (the rest train); 0: search every split")
    p.add_argument("--splits", type=int, nargs="+", default=None, metavar="G",
                   help="asynchronous modes: search only these rollout-GPU counts (default: every split)")
    p.add_argument("--gpu", default="H800", choices=sorted(GPUS))
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None, metavar="F",
                   help="each server's SGLang mem_fraction_static (default: what SGLang picks for the GPU)")
    p.add_argument("--drift-variants", nargs="*", default=None, metavar="DRIVER:LATE",
                   help="the drifts the verified modes run again under (default: progress:0.8 progress:0.9 "
                   "progress:0.95 offpolicy:0.85; none: skip)")
    p.add_argument("--tail-launch", type=float, default=AlgoConfig.tail_launch, metavar="X",
                   help="on_policy_tb / rollverify_tb: groups a regular round launches, in batches of B (default 1.5)")
    p.add_argument("--steps", type=int, default=SimConfig.steps, help="simulated steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-on", default="trainer", choices=VERIFY_ON,
                   help="where rollverify's new log-probs come from: a trainer forward, or the engines' prefill")
    p.add_argument("--tool-calls", type=int, default=0, metavar="N",
                   help="multi-turn: at most N tool calls per trajectory, P(c) ~ (c+1)^-alpha (0: single-turn)")
    p.add_argument("--tool-alpha", type=float, default=ToolModel.alpha, help="the calls' power law (default 1.2)")
    p.add_argument("--tool-latency", type=float, default=ToolModel.latency_median_s, metavar="S",
                   help="median seconds of one call (log-normal; default 5)")
    p.add_argument("--tool-sigma", type=float, default=ToolModel.latency_sigma,
                   help="log-std of a call's latency (default 1: p99 ~10x the median)")
    p.add_argument("--tools-from", default=None, metavar="RUN",
                   help="learn the tool model from a multi-turn run's folder (its metrics.jsonl: the calls' median "
                   "and p99 seconds, turns per trajectory) instead of the --tool-* values")
    p.add_argument("--force", action="store_true", help="replace an earlier simulate.json / simulate.png in --out")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        if a.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {a.steps}")
        written = [f for f in (out / "simulate.json", out / "simulate.png") if f.exists()]
        if written and not a.force:
            raise ValueError(f"{written[0]} exists; pass --force to replace it or choose another --out")
        for c in a.contexts:
            Workload(context=c)
        tools = ToolModel(max_calls=a.tool_calls, alpha=a.tool_alpha, latency_median_s=a.tool_latency,
                          latency_sigma=a.tool_sigma)
        if a.tools_from is not None:
            from rollverify.metrics import load_metrics

            if not (Path(a.tools_from) / "metrics.jsonl").is_file():
                raise ValueError(f"--tools-from {a.tools_from}: no metrics.jsonl there (a run folder?)")
            tools = ToolModel.fit(load_metrics(a.tools_from))
            a.tool_calls, a.tool_alpha = tools.max_calls, tools.alpha
            a.tool_latency, a.tool_sigma = tools.latency_median_s, tools.latency_sigma
        variants = DEFAULT_VARIANTS if a.drift_variants is None else tuple(map(sensitivity.parse_variant,
                                                                                 a.drift_variants))
        cluster = ClusterSpec(gpu=a.gpu, gpus=a.gpus, tp=a.tp, mem_fraction_static=a.mem_fraction_static)
        cfg = SimConfig(cluster=cluster, steps=a.steps, seed=a.seed,
                        algo=AlgoConfig(verify_on=a.verify_on, tail_launch=a.tail_launch), tools=tools, rollout_gpus=a.rollout_gpus,
                        split_candidates=tuple(a.splits or ()), drift_variants=variants)
        for g in ([a.rollout_gpus] if a.rollout_gpus else []) + list(a.splits or []):
            if not 0 < g < a.gpus or g % a.tp:
                raise ValueError(f"--rollout-gpus / --splits must be multiples of --tp={a.tp} in (0, --gpus={a.gpus}) "
                                 f"so that both sides have GPUs, got {g}")
        for c in a.contexts:
            cap = CostModel(cfg.model, cluster).kv_capacity_tokens()
            if cap < c + cfg.workload.token_unit:
                raise ValueError(f"a server's KV pool ({cap} tokens) cannot hold one response at --contexts {c}: "
                                 "raise --tp or --mem-fraction-static")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    print(f"simulating {a.steps} steps per run: {len(a.contexts)} context limits x {len(a.modes)} modes; "
          + VERIFY_WHERE[a.verify_on])
    if a.tool_calls:
        print(("learnt from " + a.tools_from + ": " if a.tools_from else "") + f"tool use: up to {a.tool_calls} calls per trajectory (P(c) ~ (c+1)^-{a.tool_alpha}), each "
              f"{a.tool_latency:g} s median (log-normal, sigma {a.tool_sigma:g})")
    report = run_all(cfg, a.contexts, a.modes)
    report["results"] = {str(c): {m: r.row() for m, r in by.items()} for c, by in report["results"].items()}
    if a.tools_from is not None:
        report["inputs"] = inputs(report["config"], fitted_tools=True)
        report["guessed_inputs"] = [row["key"] for row in report["inputs"] if row["guessed"]]
    print(table(report["comparison"], cfg.floors))
    if set(a.modes) & set(ASYNC_MODES):
        print(async_table(report["comparison"], cfg.floors))
    if set(a.modes) & set(TAIL_MODES):
        print("on-policy tail batching (algo.tail_launch " + f"{cfg.algo.tail_launch:g}" + " x B launched a regular round):")
        print(tail_table(report["comparison"], {int(c): {m: RunResult(**r) for m, r in by.items()}
                                                 for c, by in report["results"].items()}, cfg.floors))
    print(floor_notes(cfg.floors))
    print(kv_table(report["results"]))
    if "sensitivity" in report:
        print("the same runs under other drifts (every value of the drift model is guessed):")
        print(sensitivity.table(report["sensitivity"], cfg.floors[-1].name if cfg.floors else None))
        print(sensitivity.conclusions_text(report["conclusions"]))
    dv = report["drift_per_version"]
    print(f"the model's drift ({dv['driver']}, late {dv['late']:g}): mean OPS of a token one version old at x = "
          + ", ".join(f"{x}: {v:.1e}" for x, v in dv["ops_one_version"].items()))
    print("guessed inputs (simulate.json 'inputs' labels every one): " + ", ".join(report["guessed_inputs"]))
    (out / "simulate.json").write_text(json.dumps(report, indent=2) + "\n")
    if "on_policy" in a.modes:
        plot(report, out / "simulate.png")
    print(f"wrote {out / 'simulate.json'}" + (f" and {out / 'simulate.png'}" if "on_policy" in a.modes else ""))
    return 0
