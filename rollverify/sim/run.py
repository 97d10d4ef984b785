"""`rollverify simulate`: GPU-days of on_policy, partial and rollverify against the context limit, from the real
`Loop` over the simulated engine and trainer, compared with the paper's Table 7."""

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
from rollverify.sim.async_run import ASYNC_MODES, simulate_async
from rollverify.sim.cost import GPUS, ClusterSpec, CostModel, ModelSpec
from rollverify.sim.engine import DriftModel, SimClock, SimEngine, SimTrainer, ToolModel, Workload
from rollverify.strategies import VERIFY_ON, AlgoConfig
from rollverify.types import Group

MODES = ("on_policy", "partial", "rollverify")  # the alternating loop, colocated (the default run)
ALL_MODES = (*MODES, *ASYNC_MODES)  # and the asynchronous schedule, disaggregated (rollverify.sim.async_run)
CONTEXTS = (8192, 16384, 32768, 65536)
# The paper's Table 7 (Qwen3-8B-Base, 32 H800, batch 128 x 8, 500 iterations): GPU-days on_policy, rollverify.
PAPER_TABLE7 = {8192: (16.6, 15.1), 32768: (98.1, 57.5), 65536: (261.0, 137.0)}
SECONDS_PER_DAY = 86400.0
VERIFY_WHERE = {
    "trainer": "verification on the trainer: a 2N-per-token forward over the carried responses",
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
    split_candidates: tuple[int, ...] = (16, 20, 24, 28)
    async_pause_s: float = 3.0  # per publish besides the weight broadcast: pause, commit, resume
    async_trainer_overhead_s: float = 5.0  # per step on the trainer besides its passes: rewards, data, the step's launch


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
    # --- the asynchronous schedule only ---
    rollout_gpus: int = 0  # GPUs serving rollouts (0: colocated, all of them take turns)
    trainer_gpus: int = 0
    max_staleness: int = 0  # the staleness bound it ran with
    trainer_busy_share: float = math.nan  # of the run: the trainer's GPUs working
    rollout_idle_share: float = math.nan  # of the run: the servers with nothing to generate
    first_step_s: float = math.nan  # the pipeline's fill (left out of step_s_mean)
    trained_staleness_max: int = 0
    returned_groups: int = 0  # groups a step's verification sent back
    split_search: dict[str, float] = field(default_factory=dict)  # rollout GPUs -> GPU-days, when searched
    step_s_by_step: list[float] = field(default_factory=list)
    # GPU-days at the mean step before the switch (async: the pipeline's fill left out too): what the schedule
    # costs while acceptance holds, most of a 500-step run, where `steps` = 20 give the collapse a fifth
    gpu_days_before_switch: float = math.nan

    def row(self) -> dict:
        return asdict(self)


def simulate(mode: str, context: int, cfg: SimConfig) -> RunResult:
    """Run the real loop for ``cfg.steps`` steps of ``mode`` at this context limit on simulated time."""
    workload = replace(cfg.workload, context=context)
    cost = CostModel(cfg.model, cfg.cluster)
    clock = SimClock()
    engine = SimEngine(cost, workload, clock, cfg.seed, drift=cfg.drift, total_steps=cfg.steps, tools=cfg.tools)
    trainer = SimTrainer(cost, cfg.drift, clock, workload.token_unit, cfg.steps, cfg.seed)
    batch = cfg.batch_groups * cfg.n
    rollout = RolloutConfig(
        batch_groups=cfg.batch_groups, n=cfg.n, max_new_tokens=workload.max_units, temperature=1.0,
        max_live=max(batch, int(cfg.max_live_batches * batch)), wait_s=0.0, phase_timeout_s=3600.0,
    )
    prompt = np.zeros(workload.prompt_tokens, np.int32)
    # the switch window covers the same share of training as in a run of paper_steps steps (at least 2 steps)
    window = max(2, round(cfg.algo.switch_window * cfg.steps / cfg.paper_steps))
    loop = Loop(
        # partial pays no verification forward: no monitoring OPS either
        replace(cfg.algo, mode=mode, switch_window=window, monitor_ops=False),
        Rollout(rollout, engine, trainer, make_group=lambda gid: Group.new(gid, prompt, cfg.n, workload.max_units),
                reward=lambda group, response: float(response.index % 2)),
    )
    steps, phases, accept, switched_at, longest = [], [], [], None, []
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
        step_s_by_step=[round(x, 2) for x in steps],
        gpu_days_before_switch=float(np.mean(steps[:switched_at - 1] if switched_at and switched_at > 1 else steps))
        * cfg.paper_steps * cfg.cluster.gpus / SECONDS_PER_DAY,
    )


def _alone(cost: CostModel, workload: Workload, units: int) -> float:
    """Seconds to decode a response of ``units`` alone on one server (a lower bound of on_policy's rollout)."""
    longest = units * workload.token_unit
    ctx = workload.prompt_tokens + np.arange(0, longest, workload.token_unit) + workload.token_unit / 2
    return float(np.sum(cost.decode_iteration(1.0, ctx)) * workload.token_unit) or math.nan


def simulate_split(mode: str, context: int, cfg: SimConfig, log=print) -> RunResult:
    """An asynchronous mode on `cfg.rollout_gpus` server GPUs, or on the best of `cfg.split_candidates`."""
    if cfg.rollout_gpus:
        return RunResult(**simulate_async(mode, context, cfg, cfg.rollout_gpus))
    runs = {}
    for g in cfg.split_candidates:
        runs[g] = RunResult(**simulate_async(mode, context, cfg, g))
        log(f"       {mode} {g} rollout / {cfg.cluster.gpus - g} trainer GPUs: {runs[g].gpu_days:.1f} GPU-days")
    best = min(runs.values(), key=lambda r: r.gpu_days)
    best.split_search = {str(g): round(r.gpu_days, 2) for g, r in runs.items()}
    return best


def run_all(cfg: SimConfig, contexts=CONTEXTS, modes=MODES, log=print) -> dict:
    results: dict[int, dict[str, RunResult]] = {}
    for context in contexts:
        results[context] = {}
        for mode in modes:
            start = time.perf_counter()
            r = simulate_split(mode, context, cfg, log) if mode in ASYNC_MODES else simulate(mode, context, cfg)
            results[context][mode] = r
            split = f"  {r.rollout_gpus} rollout GPUs, staleness <= {r.trained_staleness_max}" if r.rollout_gpus else ""
            log(f"  {context // 1024:>3}K {mode:<16} {r.gpu_days:8.1f} GPU-days  step {r.step_s_mean:7.1f} s  "
                f"verify {r.verify_share:5.1%} of it  acceptance {r.acceptance_mean:.3f}  switched at {r.switched_at}"
                + split
                + (f"  tools {r.tool_calls_per_step:.0f} calls {r.tool_s_per_step:.0f} s/step, all waiting "
                   f"{r.tool_idle_share:.1%} of rollout" if r.tool_calls_per_step else "")
                + f"  ({time.perf_counter() - start:.1f} s to simulate)")
    return {"config": _config_dict(cfg), "results": results, "comparison": compare(results)}


def compare(results: dict[int, dict[str, RunResult]]) -> list[dict]:
    rows = []
    for context, by_mode in results.items():
        base = by_mode.get("on_policy")
        row: dict = {"context": context}
        for mode, r in by_mode.items():
            row[f"{mode}_gpu_days"] = r.gpu_days
            if base is not None:
                row[f"{mode}_ratio"] = r.gpu_days / base.gpu_days
        if context in PAPER_TABLE7:
            on, rv = PAPER_TABLE7[context]
            row.update(paper_on_policy_gpu_days=on, paper_rollverify_gpu_days=rv, paper_ratio=rv / on)
            if "rollverify_ratio" in row:
                row["ratio_error"] = row["rollverify_ratio"] / (rv / on) - 1
                row["within_15pct"] = abs(row["ratio_error"]) <= 0.15
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'context':>8}{'on_policy':>11}{'partial':>10}{'rollverify':>11}{'partial/on':>11}{'rv/on':>8}"
            f"{'paper rv/on':>13}{'error':>8}  paper GPU-days (on -> rv)")
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(key: str, fmt: str, r: dict = r) -> str:
            return format(r[key], fmt) if key in r else "-"
        paper = f"{r['paper_on_policy_gpu_days']:.1f} -> {r['paper_rollverify_gpu_days']:.1f}" if "paper_ratio" in r else ""
        err = f"{r['ratio_error']:+.1%}" if "ratio_error" in r else "-"
        lines.append(
            f"{r['context'] // 1024:>7}K{f('on_policy_gpu_days', '.1f'):>11}{f('partial_gpu_days', '.1f'):>10}"
            f"{f('rollverify_gpu_days', '.1f'):>11}{f('partial_ratio', '.3f'):>11}{f('rollverify_ratio', '.3f'):>8}"
            f"{f('paper_ratio', '.3f'):>13}{err:>8}  {paper}"
        )
    return "\n".join(lines)


def async_table(rows: list[dict]) -> str:
    """The asynchronous schedule's GPU-days and ratios to on_policy (and to colocated rollverify)."""
    head = (f"{'context':>8}{'on_policy':>11}{'rollverify':>11}{'async_rv':>10}{'async_partial':>15}{'rv/on':>8}"
            f"{'async_rv/on':>13}{'async_partial/on':>18}{'async_rv/rv':>13}")
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
            f"{f('async_partial_ratio', '.3f'):>18}{rv:>13}"
        )
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
    return d


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollverify simulate", description=__doc__)
    p.add_argument("--out", default="runs/simulate", help="folder for simulate.json and simulate.png")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="context limits in tokens")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES,
                   help="async_rollverify / async_partial: the asynchronous schedule, disaggregated")
    p.add_argument("--rollout-gpus", type=int, default=0,
                   help="asynchronous modes: GPUs of the servers (the rest train); 0: search 16/20/24/28 of 32")
    p.add_argument("--gpu", default="H800", choices=sorted(GPUS))
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--tp", type=int, default=1)
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
        cfg = SimConfig(cluster=ClusterSpec(gpu=a.gpu, gpus=a.gpus, tp=a.tp), steps=a.steps, seed=a.seed,
                        algo=AlgoConfig(verify_on=a.verify_on), tools=tools, rollout_gpus=a.rollout_gpus,
                        split_candidates=tuple(g * a.gpus // 32 for g in (16, 20, 24, 28)))
        if a.rollout_gpus and not 0 < a.rollout_gpus < a.gpus:
            raise ValueError(f"--rollout-gpus must be in (0, --gpus={a.gpus}) so that both sides have GPUs, got "
                             f"{a.rollout_gpus}")
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
    print(table(report["comparison"]))
    if set(a.modes) & set(ASYNC_MODES):
        print(async_table(report["comparison"]))
    (out / "simulate.json").write_text(json.dumps(report, indent=2) + "\n")
    if "on_policy" in a.modes:
        plot(report, out / "simulate.png")
    print(f"wrote {out / 'simulate.json'}" + (f" and {out / 'simulate.png'}" if "on_policy" in a.modes else ""))
    return 0
