"""The asynchronous schedule against the alternating loop and on-policy on this machine.

    python tools/bench_async.py --out runs/bench_async --seeds 3 4 5 --steps 12
    python tools/bench_async.py --out runs/bench_async --variants async_rollverify rollverify --seeds 3 --steps 4

Each variant trains the tiny countdown model with `rollverify train` (config tiny_cpu, its own SGLang server and a
world-size-1 trainer, eval at the last step) once per seed, one run at a time. Per run it records trained tokens
per wall-clock second of the steps (evaluation and start-up left out), the engine's decode iterations per step
(hardware-neutral: each running response gains one token per iteration), the wall step time, the eval reward with
its standard error over the prompts, the mean OPS of the trained tokens against the policy that trained them
(`trained_ops_mean`) and the tokens generated per token trained. It prints mean [min, max] over the seeds and
writes everything to OUT/bench_async.json (refusing to replace it without --force).

Throughput on a CPU: the server and the trainer share the cores, so the asynchronous schedule's overlap gains
only what the cores leave idle (on a GPU cluster each side has its own devices). Run it on an idle machine: the
figures of a loaded one say little.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

VARIANTS = {
    "on_policy": ["algo.mode=on_policy"],
    "rollverify": ["algo.mode=rollverify"],
    "async_rollverify": ["algo.mode=rollverify", "algo.schedule=async", "cluster.placement=disaggregated"],
    "async_partial": ["algo.mode=partial", "algo.schedule=async", "cluster.placement=disaggregated"],
}
FIGURES = ("trained_tokens_per_s", "decode_iters", "step_s", "eval_reward", "eval_reward_se", "trained_ops_mean",
           "acceptance_rate", "generated_per_trained")


def one_run(variant: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    from rollverify.app.config import load_config
    from rollverify.app.train import train
    from rollverify.metrics import load_metrics

    cfg = load_config("tiny_cpu", [*VARIANTS[variant], f"seed={seed}", f"trainer.steps={steps}",
                                   f"eval.every={steps}", "log.plots=false", "log.tensorboard=false",
                                   "log.checkpoint_every=0", "log.export_final=false", *extra])
    summary = train(cfg, out, progress=False)
    rows = load_metrics(out)
    ledger = summary["ledger"]
    step_s = sum(r["step_s"] for r in rows)

    def mean(key: str) -> float:
        xs = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        return statistics.fmean(xs) if xs else math.nan

    return {
        "trained_tokens_per_s": ledger["trained_tokens"] / step_s,
        "decode_iters": mean("decode_iters"), "step_s": step_s / len(rows),
        "eval_reward": rows[-1].get("eval_reward", math.nan), "eval_reward_se": rows[-1].get("eval_reward_se", math.nan),
        "trained_ops_mean": mean("trained_ops_mean"), "acceptance_rate": mean("acceptance_rate"),
        "generated_per_trained": (ledger["trained_tokens"] + ledger["cut_tokens"]) / ledger["trained_tokens"],
        "wall_s": summary.get("wall_s"), "ledger": ledger,
    }


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if isinstance(x, int | float) and math.isfinite(x)]
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.4g} [{min(xs):.4g}, {max(xs):.4g}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[3, 4, 5])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--force", action="store_true", help="replace OUT/bench_async.json and the run folders")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every run")
    a = p.parse_args(argv)
    out = Path(a.out)
    if (out / "bench_async.json").exists() and not a.force:
        print(f"error: {out / 'bench_async.json'} exists; pass --force or choose another --out", file=sys.stderr)
        return 2
    load = os.getloadavg()
    results: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    for seed in a.seeds:
        for v in a.variants:
            run_dir = out / f"s{seed}" / v
            if run_dir.exists() and a.force:
                import shutil

                shutil.rmtree(run_dir)
            r = one_run(v, seed, a.steps, run_dir, a.overrides)
            results.setdefault(v, []).append({"seed": seed, **r})
            print(f"seed {seed} {v:<17} " + "  ".join(f"{k} {r[k]:.4g}" for k in FIGURES), flush=True)
    report = {
        "command": sys.argv, "steps": a.steps, "seeds": a.seeds, "load_avg_at_start": load,
        "load_avg_at_end": os.getloadavg(), "cpus": os.cpu_count(), "wall_s": time.perf_counter() - t0,
        "runs": results,
        "summary": {v: {k: spread([r[k] for r in rs]) for k in FIGURES} for v, rs in results.items()},
    }
    print(f"\nmean [min, max] over seeds {a.seeds}, {a.steps} steps; load average {load[0]:.1f} at the start, "
          f"{report['load_avg_at_end'][0]:.1f} at the end")
    for v, s in report["summary"].items():
        print(f"  {v:<17} " + "  ".join(f"{k} {s[k]}" for k in FIGURES))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_async.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'bench_async.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
