"""Aggregate `rollverify demo` runs over seeds: each mode's figures as mean and [min, max] across seeds.

    for s in 0 1 2; do rollverify demo --modes on_policy partial rollverify --out runs/seeds/s$s seed=$s; done
    python tools/experiments/compare_seeds.py runs/seeds/s0 runs/seeds/s1 runs/seeds/s2 --json runs/seeds/summary.json

Against the project's targets for RollVerify it prints, each per seed and as mean [min, max] over the seeds:
RollVerify's decode iterations per step over on-policy's (the hardware-neutral rollout time: the engine's
sequential decode iterations, what rollout time follows on a GPU) and its wall step time over on-policy's (this
machine's), whether its eval reward lies within on-policy's spread over the seeds (each eval figure with its
own standard error over the prompts), the mean OPS of the trained tokens against naive partial rollout's, and
the tokens each mode generated per token it trained ((trained + cut) / trained: a run's last carried responses,
still in flight when it stops, are neither). Below the summary, one row per seed and mode (PER_SEED).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from rollverify.metrics import load_metrics

FIGURES = (
    "reward_last",
    "eval_last",
    "eval_se",
    "decode_iters",
    "step_s",
    "rollout_s",
    "ops_mean",
    "trained_ops_mean",
    "acceptance_rate",
    "generated_per_trained",
)


# the per-seed rows printed below the summary (every FIGURES entry is in the JSON's per_seed lists)
PER_SEED = ("eval_last", "eval_se", "decode_iters", "step_s", "trained_ops_mean", "acceptance_rate",
            "generated_per_trained")


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if isinstance(x, int | float) and math.isfinite(x)]


def collect(dirs: list[Path]) -> dict[str, list[dict]]:
    """mode -> one demo.json entry per seed directory (plus the number of steps that switched to on-policy)."""
    runs: dict[str, list[dict]] = {}
    for d in dirs:
        results = json.loads((d / "demo.json").read_text())
        for mode, r in results.items():
            rows = load_metrics(d / mode)
            ledger = json.loads((d / mode / "summary.json").read_text()).get("ledger", {})
            trained = ledger.get("trained_tokens") or float("nan")
            r = {
                **r,
                # tokens generated per token trained, the responses still in flight at the end left out (they
                # are trained later): (trained + cut) / trained
                "generated_per_trained": (trained + ledger.get("cut_tokens", 0)) / trained,
                "switched_at": next((x["step"] for x in rows if x.get("switched")), None),
                "seed_dir": str(d),
            }
            runs.setdefault(mode, []).append(r)
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict:
    out: dict = {"modes": {}}
    for mode, rs in runs.items():
        out["modes"][mode] = {
            f: {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "per_seed": v}
            for f in FIGURES
            if (v := _finite([r[f] for r in rs]))
        }
        out["modes"][mode]["switched_at"] = [r["switched_at"] for r in rs]
    m = out["modes"]
    if "on_policy" in m and "rollverify" in m:
        pairs = list(zip(runs["rollverify"], runs["on_policy"], strict=True))
        ratios = [rv["step_s"] / op["step_s"] for rv, op in pairs]
        iters = [rv.get("decode_iters", float("nan")) / op.get("decode_iters", float("nan")) for rv, op in pairs]
        ev = m["on_policy"].get("eval_last", {})
        rv_eval = m["rollverify"].get("eval_last", {}).get("mean", float("nan"))
        out["targets"] = {
            "decode_iters_ratio_per_seed": iters,
            "decode_iters_ratio": _spread(iters),
            "decode_iters_target": 0.6,
            "step_time_ratio_per_seed": ratios,
            "step_time_ratio_pooled": m["rollverify"]["step_s"]["mean"] / m["on_policy"]["step_s"]["mean"],
            "step_time_target": 0.6,
            "on_policy_eval_spread": [ev.get("min"), ev.get("max")],
            "rollverify_eval_mean": rv_eval,
            # the target: not below on-policy's spread (above it is better than on-policy, not a miss)
            "rollverify_eval_vs_spread": "below" if rv_eval < ev["min"] else "above" if rv_eval > ev["max"] else "within",
        }
        if "partial" in m and "trained_ops_mean" in m["partial"] and "trained_ops_mean" in m["rollverify"]:
            out["targets"]["trained_ops"] = {k: m[k]["trained_ops_mean"]["mean"] for k in ("partial", "rollverify")}
            per_seed = [
                p["trained_ops_mean"] / rv["trained_ops_mean"]
                for p, rv in zip(runs["partial"], runs["rollverify"], strict=True)
            ]
            out["targets"]["trained_ops_partial_over_rollverify_per_seed"] = per_seed
            out["targets"]["trained_ops_partial_over_rollverify"] = _spread(per_seed)
            out["targets"]["trained_ops_target"] = 3.0
    return out


def _spread(xs: list[float]) -> dict:
    v = _finite(xs)
    if not v:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="demo output directories, one per seed")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    a = ap.parse_args(argv)
    runs = collect(a.dirs)
    s = summarize(runs)
    print(f"{len(a.dirs)} seeds; mean [min, max] per mode")
    print(f"{'figure':<18}" + "".join(f"{mode:>28}" for mode in s["modes"]))
    for f in FIGURES:
        cells = []
        for mode in s["modes"]:
            v = s["modes"][mode].get(f)
            cells.append(f"{v['mean']:.4g} [{v['min']:.3g}, {v['max']:.3g}]" if v else "-")
        print(f"{f:<18}" + "".join(f"{c:>28}" for c in cells))
    print(f"{'switched at step':<18}" + "".join(f"{str(s['modes'][m]['switched_at']):>28}" for m in s["modes"]))
    print("\nper seed")
    w = max(len(f) for f in PER_SEED) + 2
    print(f"{'seed dir':<24}{'mode':<12}" + "".join(f"{f:>{w}}" for f in PER_SEED))
    for i, d in enumerate(a.dirs):
        for mode, rs in runs.items():
            r = rs[i]
            print(f"{str(d):<24}{mode:<12}" + "".join(f"{r.get(f, math.nan):>{w}.4g}" for f in PER_SEED))
    if "targets" in s:
        t = s["targets"]
        d = t["decode_iters_ratio"]
        print(f"\ndecode iterations per step rollverify / on_policy: {d['mean']:.2f} [{d['min']:.2f}, {d['max']:.2f}] "
              f"(target <= 0.6), per seed {', '.join(f'{x:.2f}' for x in t['decode_iters_ratio_per_seed'])}")
        print(f"wall step time rollverify / on_policy (this machine): pooled {t['step_time_ratio_pooled']:.2f}, "
              f"per seed {', '.join(f'{x:.2f}' for x in t['step_time_ratio_per_seed'])}")
        lo, hi = t["on_policy_eval_spread"]
        print(f"eval reward: rollverify mean {t['rollverify_eval_mean']:.3f}, on_policy spread [{lo:.3f}, {hi:.3f}]"
              f" -> {t['rollverify_eval_vs_spread']}")
        if "trained_ops" in t:
            o = t["trained_ops_partial_over_rollverify"]
            print("mean OPS of trained tokens: " + ", ".join(f"{k} {v:.2e}" for k, v in t["trained_ops"].items())
                  + f"; partial / rollverify {o['mean']:.1f}x [{o['min']:.1f}, {o['max']:.1f}] (target >= 3)")
    if a.json:
        a.json.write_text(json.dumps(s, indent=1) + "\n")
        print(f"\nwritten: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
