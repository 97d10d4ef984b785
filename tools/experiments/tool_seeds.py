"""Aggregate `rollverify demo --tools` runs over seeds: the multi-turn figures of docs/results.md.

    for s in 0 1 2; do rollverify demo --tools --modes on_policy partial rollverify --out runs/tools/s$s seed=$s; done
    python tools/experiments/tool_seeds.py runs/tools/s0 runs/tools/s1 runs/tools/s2 --json runs/tools/summary.json

Per mode, as mean [min, max] over the seeds: decode iterations per step and their ratio to on-policy's (the
engine's sequential decode iterations of a phase, what rollout time follows on a GPU), wall step time, tool
seconds per step (the calls' own time, summed), tool calls per step, turns per trained trajectory (mean over
steps, and the largest per-step p99), the share of environment tokens in trained trajectories, the eval reward
with its 95 % interval over the prompts (where the mode was evaluated), acceptance and the tokens generated per
token trained (policy tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollverify.metrics import load_metrics  # noqa: E402


def _vals(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def _mean(rows: list[dict], key: str) -> float:
    v = _vals(rows, key)
    return statistics.fmean(v) if v else math.nan


def per_run(run: Path) -> dict[str, float]:
    rows = load_metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    led = summary.get("ledger", {})
    trained = led.get("trained_tokens", 0)
    ev = [r for r in rows if isinstance(r.get("eval_reward"), int | float)]
    return {
        "decode_iters": _mean(rows, "decode_iters"),
        "step_s": _mean(rows, "step_s"),
        "tool_s": _mean(rows, "tools/tool_s_sum"),
        "tool_calls": _mean(rows, "tools/calls"),
        "turns_mean": _mean(rows, "tools/turns_mean"),
        "turns_p99": max(_vals(rows, "tools/turns_p99"), default=math.nan),
        "env_share": _mean(rows, "tools/env_token_share"),
        "reward": _mean(rows[-3:], "reward_mean"),
        "eval": ev[-1]["eval_reward"] if ev else math.nan,
        "eval_se": ev[-1].get("eval_reward_se", math.nan) if ev else math.nan,
        "acceptance": _mean(rows, "acceptance_rate"),
        "generated_per_trained": (trained + led.get("cut_tokens", 0)) / trained if trained else math.nan,
        "errors": sum(_vals(rows, "tools/errors")),
        "outputs": sum(_vals(rows, "tools/outputs")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("demos", nargs="+", help="demo folders (one per seed), each with <mode>/ run folders")
    p.add_argument("--json", default=None, help="write the per-seed figures and the summary to this new file")
    a = p.parse_args(argv)
    seeds: dict[str, dict[str, dict[str, float]]] = {}
    for d in map(Path, a.demos):
        for run in sorted(x for x in d.iterdir() if (x / "metrics.jsonl").is_file()):
            seeds.setdefault(run.name, {})[d.name] = per_run(run)
    base = seeds.get("on_policy", {})
    for by_seed in seeds.values():
        for seed, f in by_seed.items():
            b = base.get(seed)
            f["decode_ratio"] = f["decode_iters"] / b["decode_iters"] if b else math.nan
            f["step_ratio"] = f["step_s"] / b["step_s"] if b else math.nan
    keys = ("decode_iters", "decode_ratio", "step_s", "step_ratio", "tool_s", "tool_calls", "turns_mean",
            "turns_p99", "env_share", "reward", "acceptance", "generated_per_trained")
    summary: dict[str, dict[str, list[float]]] = {}
    print(f"{'mode':<11}" + "".join(f"{k:>24}" for k in keys))
    for mode, by_seed in seeds.items():
        summary[mode] = {}
        cells = []
        for k in keys:
            v = [f[k] for f in by_seed.values() if math.isfinite(f[k])]
            summary[mode][k] = [statistics.fmean(v), min(v), max(v)] if v else [math.nan] * 3
            cells.append(f"{summary[mode][k][0]:.3g} [{summary[mode][k][1]:.3g}, {summary[mode][k][2]:.3g}]"
                         if v else "-")
        print(f"{mode:<11}" + "".join(f"{c:>24}" for c in cells))
    print("\neval reward (95 % interval over the prompts) per seed:")
    for mode, by_seed in seeds.items():
        parts = [f"{s} {f['eval']:.3f} +- {1.96 * f['eval_se']:.3f}" for s, f in by_seed.items()
                 if math.isfinite(f["eval"])]
        if parts:
            print(f"  {mode}: " + "; ".join(parts))
    if a.json:
        out = Path(a.json)
        if out.exists():
            print(f"error: {out} exists; give a new file name", file=sys.stderr)
            return 2
        out.write_text(json.dumps({"per_seed": seeds, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
