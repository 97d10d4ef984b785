"""The paper's Tables 3-6 and Figures 4 and 5(b) on the tiny task: run every configuration over seeds, aggregate.

    python tools/experiments/paper_tables.py --out runs/paper                 # every run, 3 seeds (hours), then the tables
    python tools/experiments/paper_tables.py --out runs/paper --aggregate     # tables and figures from the runs already there
    python tools/experiments/paper_tables.py --out runs/quick --quick         # 2 runs x 1 seed x 2 small steps: the pipeline

Each distinct configuration runs once per seed (Table 6's partial GRPO is Table 3's partial, d_s = 0.01 with the
sequence stage only is Table 3's "+ sequence stage", and so on) into OUT/<run>/s<seed>, through `rollverify train`
against one SGLang server that every run shares (each run pushes its trainer's initial weights first). A run
whose summary.json exists is skipped, so an interrupted batch continues where it stopped; `--set key=value`
applies to every run. The results go to OUT/paper_tables.md and .json (every cell: mean [min, max] over the
seeds) and OUT/figures/; each qualitative claim of the paper is checked against the numbers, "n/a" where a run
it needs is missing. Every table gives the cost three ways: the priced cost per step (decode iterations plus
generated and prefilled tokens in iteration-equivalents, rollverify/pricing.py), decode iterations alone, and the
tokens generated per token trained; a speed claim reads the priced cost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

from rollverify.metrics import load_metrics
from rollverify.pricing import run_cost

ROLLVERIFY = ["algo.mode=rollverify"]
SEQ = [*ROLLVERIFY, "algo.token_stage=false", "algo.conditional_switch=false"]  # d_s = 0.01
SEQ_TOKEN = [*ROLLVERIFY, "algo.conditional_switch=false"]  # d_s = 0.01, d_t = 2
PARTIAL = ["algo.mode=partial"]
RUNS: dict[str, list[str]] = {
    "on_policy": ["algo.mode=on_policy"],
    "partial": PARTIAL,
    "seq": SEQ,
    "seq_token": SEQ_TOKEN,
    "rollverify": ROLLVERIFY,
    "ds_0.005": [*SEQ, "algo.d_s=0.005"],
    "ds_0.02": [*SEQ, "algo.d_s=0.02"],
    "ds_0.05": [*SEQ, "algo.d_s=0.05"],
    "ds_auto": [*SEQ, "algo.d_s=auto"],  # set from the measured one-version drift (rollverify/calibration.py)
    "rollverify_auto": [*ROLLVERIFY, "algo.d_s=auto", "algo.d_t=auto"],
    "dt_1": [*SEQ_TOKEN, "algo.d_t=1.0"],
    "dt_4": [*SEQ_TOKEN, "algo.d_t=4.0"],
    "partial_gspo": [*PARTIAL, "trainer.loss=gspo"],
    "partial_sapo": [*PARTIAL, "trainer.loss=sapo"],
    "partial_vespo": [*PARTIAL, "trainer.loss=vespo"],
    # the field's stale-token corrections on partial rollout (rollverify.losses.behaviour_correction; SPEC-RL
    # re-scores and cuts carried responses, like RollVerify, with its own rule)
    "partial_mask_offpolicy": [*PARTIAL, "trainer.correction.method=mask_offpolicy"],
    "partial_decoupled": [*PARTIAL, "trainer.correction.method=decoupled"],
    "partial_icepop": [*PARTIAL, "trainer.correction.method=icepop"],
    "partial_m2po": [*PARTIAL, "trainer.correction.method=m2po"],
    "partial_seq_mis": [*PARTIAL, "trainer.correction.method=seq_mis"],
    "partial_geo_rs": [*PARTIAL, "trainer.correction.method=geo_rs"],
    "spec_rl": ["algo.mode=spec_rl"],
}
FIELD = [("partial + slime off-policy mask", "partial_mask_offpolicy"), ("partial + AReaL decoupled PPO", "partial_decoupled"),
         ("partial + slime IcePop", "partial_icepop"), ("partial + AReaL M2PO", "partial_m2po"),
         ("partial + verl seq-MIS", "partial_seq_mis"), ("partial + verl Geo-RS", "partial_geo_rs"),
         ("SPEC-RL cut", "spec_rl")]
# table -> (row label, run); d_s = inf with the sequence stage only verifies nothing: it is partial rollout
TABLES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "table2": ("Table 2: on-policy, partial rollout and RollVerify",
               [("on-policy GRPO", "on_policy"), ("partial rollout", "partial"), ("RollVerify", "rollverify"),
                ("RollVerify, auto thresholds", "rollverify_auto")]),
    "table3": ("Table 3: ablation", [("partial", "partial"), ("+ sequence stage", "seq"),
                                     ("+ token stage", "seq_token"), ("+ conditional switch", "rollverify"),
                                     ("on-policy", "on_policy")]),
    "table4": ("Table 4: d_s, sequence stage only", [("0.005", "ds_0.005"), ("0.01", "seq"), ("0.02", "ds_0.02"),
                                                     ("0.05", "ds_0.05"), ("inf", "partial"), ("auto", "ds_auto")]),
    "table5": ("Table 5: d_t, d_s = 0.01", [("1", "dt_1"), ("2", "seq_token"), ("4", "dt_4"), ("inf", "seq")]),
    "table6": ("Table 6: loss reshaping vs sample verification",
               [("on-policy GRPO", "on_policy"), ("partial GRPO", "partial"), ("partial GSPO", "partial_gspo"),
                ("partial SAPO", "partial_sapo"), ("partial VESPO", "partial_vespo"), *FIELD,
                ("RollVerify", "rollverify"), ("RollVerify, auto thresholds", "rollverify_auto")]),
}
COLUMNS = {  # column -> (header, format)
    "step_s": ("step time (s)", "{:.2f}"),
    "eval_reward": ("eval reward", "{:.3f}"),
    "trained_ops": ("OPS of trained tokens", "{:.3g}"),
    "acceptance": ("acceptance", "{:.3f}"),
    "decode_iters": ("decode iters/step", "{:.1f}"),
    "generated_per_trained": ("generated / trained tokens", "{:.2f}"),
    "priced": ("priced iters/step", "{:.1f}"),  # rollverify/pricing.py
    "wall_min": ("run time (min)", "{:.1f}"),
    "eval_interval": ("eval reward, 95 % interval (over seeds; one seed: over prompts)", ""),
}
QUICK = ["trainer.steps=2", "rollout.batch_groups=2", "rollout.n=2", "rollout.max_new_tokens=48", "rollout.max_live=8",
         "eval.every=2", "eval.n_prompts=8", "log.checkpoint_every=0"]
QUIET = ["log.plots=false", "log.tensorboard=false"]


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)]


def _mean(xs) -> float | None:
    xs = _finite(xs)
    return statistics.fmean(xs) if xs else None


def _thirds(records: list[dict], key: str) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and the last third of the steps."""
    k = max(1, len(records) // 3)
    return _mean(r.get(key) for r in records[:k]), _mean(r.get(key) for r in records[-k:])


def run_figures(run_dir: Path) -> dict | None:
    """One finished run's figures, or None when it has not finished."""
    if not (run_dir / "summary.json").exists():
        return None
    records = load_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    cost = run_cost(records, ledger)
    evals = _finite(r.get("eval_reward") for r in records)
    ops_first, ops_last = _thirds(records, "trained_ops_mean")
    ent_first, ent_last = _thirds(records, "train/entropy")
    return {
        "step_s": _mean(r.get("step_s") for r in records),
        "eval_reward": evals[-1] if evals else None,
        "eval_se": next((r.get("eval_reward_se") for r in reversed(records) if _finite([r.get("eval_reward")])), None),
        "trained_ops": _mean(r.get("trained_ops_mean") for r in records),
        "acceptance": _mean(r.get("acceptance_rate") for r in records),
        "decode_iters": _mean(r.get("decode_iters") for r in records),
        "generated_per_trained": cost["generated_per_trained"],
        "priced": cost["priced"],
        "wall_min": summary["wall_s"] / 60 if "wall_s" in summary else None,
        "ops_first_third": ops_first, "ops_last_third": ops_last,
        "entropy_first_third": ent_first, "entropy_last_third": ent_last,
        "switched_at": next((r["step"] for r in records if r.get("switched")), None),
    }


def aggregate(out: Path, seeds: list[int]) -> dict:
    """run -> figure -> {mean, min, max, n} over the seeds that finished."""
    agg: dict[str, dict] = {}
    for name in RUNS:
        per_seed = [f for s in seeds if (f := run_figures(out / name / f"s{s}")) is not None]
        agg[name] = {"seeds": len(per_seed)}
        for key in per_seed[0] if per_seed else []:
            if vals := _finite(f[key] for f in per_seed):
                agg[name][key] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        if ev := _finite(f["eval_reward"] for f in per_seed):
            # the 95 % interval of the mean eval reward: over seeds (2 or more), else the one evaluation's own
            se = statistics.stdev(ev) / math.sqrt(len(ev)) if len(ev) > 1 else _mean(f["eval_se"] for f in per_seed)
            if se is not None:
                agg[name]["eval_interval"] = {"mean": statistics.fmean(ev), "half": 1.96 * se, "n": len(ev)}
    return agg


def _cell(agg: dict, run: str, key: str, fmt: str) -> str:
    v = agg.get(run, {}).get(key)
    if not v:
        return "—"
    if key == "eval_interval":
        return f"{v['mean']:.3f} +- {v['half']:.3f}"
    return f"{fmt.format(v['mean'])} [{fmt.format(v['min'])}, {fmt.format(v['max'])}]"


def _m(agg: dict, run: str, key: str) -> float | None:
    v = agg.get(run, {}).get(key)
    return v["mean"] if v else None


def claims(agg: dict) -> list[tuple[str, str, str]]:
    """(claim, yes / no / n/a, the numbers) for each qualitative claim of the paper, on seed means."""

    def have(*xs) -> bool:
        return all(x is not None for x in xs)

    out = []
    f = _fmt
    ev = {r: _m(agg, r, "eval_reward") for r in RUNS}
    ops = {r: _m(agg, r, "trained_ops") for r in RUNS}
    p_first, p_last = _m(agg, "partial", "ops_first_third"), _m(agg, "partial", "ops_last_third")
    e_first, e_last = _m(agg, "partial", "entropy_first_third"), _m(agg, "partial", "entropy_last_third")
    ok = have(ev["partial"], ev["on_policy"], p_first, p_last, e_first, e_last)
    out.append(("partial rollout loses accuracy, and its OPS and entropy grow",
                "n/a" if not ok else "yes" if ev["partial"] < ev["on_policy"] and p_last > p_first and e_last > e_first
                else "no",
                f"eval partial {f(ev['partial'])} vs on-policy {f(ev['on_policy'])}; partial OPS first/last third "
                f"{f(p_first)} -> {f(p_last)}; entropy {f(e_first)} -> {f(e_last)}"))
    chain = ["partial", "seq", "seq_token", "rollverify"]
    ok = have(*(ev[r] for r in chain), *(ops[r] for r in chain[:3]))
    helps = ok and all(ev[a] <= ev[b] for a, b in itertools.pairwise(chain)) and ops["partial"] > ops["seq"] > ops["seq_token"]
    out.append(("each stage helps (eval reward up, trained OPS down along partial -> +seq -> +token -> +switch)",
                "n/a" if not ok else "yes" if helps else "no",
                "; ".join(f"{r}: eval {f(ev[r])}, OPS {f(ops[r])}" for r in chain)))
    a_seq, a_tok = _m(agg, "seq", "acceptance"), _m(agg, "seq_token", "acceptance")
    out.append(("the token stage raises acceptance", "n/a" if not have(a_seq, a_tok) else "yes" if a_tok > a_seq else "no",
                f"acceptance sequence stage only {f(a_seq)}, with the token stage {f(a_tok)}"))
    ds = [(0.005, "ds_0.005"), (0.01, "seq"), (0.02, "ds_0.02"), (0.05, "ds_0.05")]
    pts = [(d, ev[r], _m(agg, r, "priced"), _m(agg, r, "decode_iters")) for d, r in ds]
    ok = all(have(e, p) for _, e, p, _ in pts)
    trend = ok and _spearman([d for d, *_ in pts], [e for _, e, _, _ in pts]) < 0 and _spearman(
        [d for d, *_ in pts], [p for _, _, p, _ in pts]) < 0
    out.append(("smaller d_s is more accurate and slower (rank correlation of d_s with eval and with the priced cost "
                "per step < 0: decode iterations plus generated and prefilled tokens, rollverify/pricing.py; decode "
                "iterations alone beside it)",
                "n/a" if not ok else "yes" if trend else "no",
                "; ".join(f"d_s {d}: eval {f(e)}, {f(p)} priced iters/step ({f(i)} decode iters)"
                          for d, e, p, i in pts)))
    reshaped = ["partial_gspo", "partial_sapo", "partial_vespo"]
    ok = have(ev["rollverify"], *(ev[r] for r in reshaped))
    out.append(("loss reshaping does not close the gap that sample verification closes (each reshaped partial run "
                "below RollVerify's eval)",
                "n/a" if not ok else "yes" if all(ev[r] < ev["rollverify"] for r in reshaped) else "no",
                "; ".join(f"{r}: eval {f(ev[r])}, OPS {f(ops[r])}" for r in [*reshaped, "rollverify"])))
    return out


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else 0.0


def figures(out: Path, seeds: list[int]) -> list[Path]:
    """Figure 4 (reward, entropy, OPS, response length over steps; on-policy, partial, RollVerify) and Figure 5(b)
    (acceptance and rollout time over steps without the switch), each line the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_series(run: str, key: str) -> tuple[list[int], list[float]]:
        by_step: dict[int, list[float]] = {}
        for s in seeds:
            if (out / run / f"s{s}" / "metrics.jsonl").exists():
                for r in load_metrics(out / run / f"s{s}"):
                    if v := _finite([r.get(key)]):
                        by_step.setdefault(r["step"], []).append(v[0])
        steps = sorted(by_step)
        return steps, [statistics.fmean(by_step[k]) for k in steps]

    specs = {
        "fig4.png": (["on_policy", "partial", "rollverify"],
                     [("reward_mean", "train reward"), ("train/entropy", "entropy"), ("trained_ops_mean", "OPS of trained tokens"),
                      ("response_length_mean", "response length (tokens)")]),
        "fig5b.png": (["seq_token"], [("acceptance_rate", "acceptance"), ("rollout_s", "rollout time (s)")]),
    }
    paths = []
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for fname, (runs, panels) in specs.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
        for ax, (key, label) in zip(axes[0], panels, strict=True):
            for run in runs:
                xs, ys = mean_series(run, key)
                if xs:
                    ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=run)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "figures" / fname, dpi=90)
        plt.close(fig)
        paths.append(out / "figures" / fname)
    return paths


def write_report(out: Path, seeds: list[int], agg: dict, figs: list[Path], log: dict) -> Path:
    lines = [f"# The paper's tables on the tiny task ({len(seeds)} seed(s): {seeds}; cells: mean [min, max])", ""]
    for title, rows in TABLES.values():
        keys = ["eval_reward", "eval_interval", "trained_ops", "priced", "decode_iters", "generated_per_trained",
                "step_s"] if "Table 6" in title or "Table 2" in title else \
            ["priced", "decode_iters", "generated_per_trained", "step_s", "eval_reward", "trained_ops", "acceptance"]
        lines += [f"## {title}", "", "| | " + " | ".join(COLUMNS[k][0] for k in keys) + " | seeds |",
                  "|---" * (len(keys) + 2) + "|"]
        for label, run in rows:
            cells = [_cell(agg, run, k, COLUMNS[k][1]) for k in keys]
            lines.append(f"| {label} (`{run}`) | " + " | ".join(cells) + f" | {agg.get(run, {}).get('seeds', 0)} |")
        lines.append("")
    lines += ["## The paper's claims", ""]
    lines += [f"- **{c}**: {verdict}. {numbers}" for c, verdict, numbers in claims(agg)]
    lines += ["", "## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in figs]
    lines += ["", f"Runs this invocation: {len(log['ran'])} in {log['wall_s'] / 60:.1f} min; failed: {log['failed']}."]
    path = out / "paper_tables.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "paper_tables.json").write_text(json.dumps({"seeds": seeds, "runs": RUNS, "figures": agg,
                                                       "claims": claims(agg), "log": log}, indent=1) + "\n")
    return path


def run_all(out: Path, names: list[str], seeds: list[int], extra: list[str], log: dict,
            config: str = "tiny_cpu") -> None:
    """Every (run, seed) without a summary.json, in-process, against one shared server."""
    from rollverify.app.config import load_config
    from rollverify.app.start import resolve_model
    from rollverify.app.train import train
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    todo = [(n, s) for s in seeds for n in names if not (out / n / f"s{s}" / "summary.json").exists()]
    if not todo:
        return
    base = load_config(config, extra)  # checks --set before anything starts
    cpu_compat.activate()
    out.mkdir(parents=True, exist_ok=True)
    with launch_server(resolve_model(base), engine_args=base.servers.engine_args.args(),
                       log_path=out / "server.log") as server:
        for name, seed in todo:
            run_dir = out / name / f"s{seed}"
            t0 = time.perf_counter()
            print(f"[paper_tables] {name} seed {seed} -> {run_dir}", flush=True)
            try:  # a row the base config refuses (e.g. a correction that needs TIS) is reported like a failed run
                cfg = load_config(config, [*RUNS[name], *extra, f"seed={seed}",
                                           f'servers.endpoints=["{server.endpoint}"]'])
                train(cfg, run_dir, progress=False, overwrite=run_dir.exists())
                log["ran"].append([name, seed, time.perf_counter() - t0])
            except Exception:  # one failed run must not stop the batch: it is reported and rerun next time
                traceback.print_exc()
                log["failed"].append([name, seed])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--config", default="tiny_cpu", help="the base config of every run (a shipped name or a file)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=None, help="a subset of the runs (default: all)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides for every run, e.g. trainer.steps=60 trainer.lr=3e-4")
    p.add_argument("--aggregate", action="store_true", help="run nothing: tables and figures from OUT as it is")
    p.add_argument("--quick", action="store_true",
                   help="on_policy and rollverify, seed 0, 2 small steps: shows the pipeline works, nothing more")
    a = p.parse_args(argv)
    seeds, names, extra = a.seeds, a.runs or list(RUNS), [*QUIET, *a.overrides]
    if a.quick:
        seeds, names, extra = [0], a.runs or ["on_policy", "rollverify"], [*QUIET, *QUICK, *a.overrides]
    log: dict = {"ran": [], "failed": [], "overrides": extra}
    t0 = time.perf_counter()
    if not a.aggregate:
        run_all(a.out, names, seeds, extra, log, a.config)
    log["wall_s"] = time.perf_counter() - t0
    agg = aggregate(a.out, seeds)
    report = write_report(a.out, seeds, agg, figures(a.out, seeds), log)
    print(report.read_text())
    return 1 if log["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
