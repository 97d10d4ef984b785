"""`rollverify demo` (what `make demo` runs): on-policy GRPO and RollVerify side by side on the tiny CPU default.

Both runs share one SGLang server (each run first pushes its trainer's initial weights to it), use the same
seed and the same number of steps, and write their own run directory; a table and a comparison plot follow.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from rollverify.config import load_config
from rollverify.metrics import load_metrics, plot_comparison

MODES = ("on_policy", "rollverify")
COLUMNS = (
    ("final train reward", "reward_last"),
    ("eval reward", "eval_last"),
    ("wall s", "wall_s"),
    ("rollout s/step", "rollout_s"),
    ("step s", "step_s"),
    ("mean OPS (carried)", "ops_mean"),
    ("trained OPS", "trained_ops_mean"),
    ("acceptance", "acceptance_rate"),
)


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def _last(rows: list[dict], key: str, n: int = 5) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return sum(vals[-n:]) / len(vals[-n:]) if vals else float("nan")


def table(results: dict[str, dict]) -> str:
    head = f"{'mode':<12}" + "".join(f"{name:>20}" for name, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        cells = "".join(f"{r[key]:>20.3f}" if isinstance(r[key], float) else f"{r[key]:>20}" for _, key in COLUMNS)
        lines.append(f"{mode:<12}{cells}")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollverify demo", description=__doc__)
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--modes", nargs="+", default=list(MODES), help="algo.mode of each run (on_policy is the baseline)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to both runs")
    a = p.parse_args(argv)

    from rollverify.train import resolve_model, train
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    base = [f"trainer.steps={a.steps}", *a.overrides]
    try:  # a bad mode or override stops here, before a server starts
        cfg0 = load_config(a.config, base)
        for mode in a.modes:
            load_config(a.config, [*base, f"algo.mode={mode}"])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu_compat.activate()
    print(f"[demo] tiny model: {resolve_model(cfg0)}")
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    with launch_server(resolve_model(cfg0), engine_args=dict(cfg0.rollout.engine_args),
                       log_path=out / "server.log") as server:
        print(f"[demo] SGLang server at {server.endpoint} ({time.perf_counter() - t0:.0f} s to start)")
        for mode in a.modes:
            cfg = load_config(a.config, [*base, f"algo.mode={mode}", f'rollout.endpoints=["{server.endpoint}"]'])
            print(f"[demo] {mode}: {a.steps} steps -> {out / mode}")
            summary = train(cfg, out / mode, progress=True)
            rows = load_metrics(out / mode)
            results[mode] = {
                "reward_last": _last(rows, "reward_mean"),
                "eval_last": _last(rows, "eval_reward", 1),
                "wall_s": float(summary.get("wall_s", float("nan"))),
                "rollout_s": _mean(rows, "rollout_s"),
                "step_s": _mean(rows, "step_s"),
                "ops_mean": _mean(rows, "ops_mean"),
                "trained_ops_mean": _mean(rows, "trained_ops_mean"),
                "acceptance_rate": _mean(rows, "acceptance_rate"),
            }
    plot = plot_comparison({m: out / m for m in a.modes}, out / "comparison.png")
    print()
    print(table(results))
    print()
    if "on_policy" in results:
        for mode in [m for m in results if m != "on_policy"]:
            speed = results[mode]["step_s"] / results["on_policy"]["step_s"]
            print(f"[demo] {mode} mean step time = {speed:.2f} x on-policy's")
    print(f"[demo] total {time.perf_counter() - t0:.0f} s")
    print(f"[demo] plots: {plot} and {out}/<mode>/plots/")
    (out / "demo.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0
