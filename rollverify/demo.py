"""`rollverify demo` (what `make demo` runs): on-policy GRPO and RollVerify side by side on the tiny CPU default.

Both runs share one SGLang server (each run first pushes its trainer's initial weights to it), use the same
seed and the same number of steps, and write their own run folder under the demo's folder; a table and a
comparison plot follow. Without --out the demo writes to runs/demo, or runs/demo-2, -3, ... when that holds an
earlier demo; an explicit --out that holds one is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from rollverify import rundir
from rollverify.config import load_config
from rollverify.console import fmt, quiet_cpu_warnings, say, stage
from rollverify.metrics import load_metrics, plot_comparison

MODES = ("on_policy", "rollverify")
DEFAULT_OUT = "runs/demo"
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
    """One row per mode; `-` where a figure does not apply (no carried responses under on_policy, no eval)."""
    head = f"{'mode':<12}" + "".join(f"{name:>20}" for name, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        cells = "".join(f"{fmt(r.get(key), '.3f'):>20}" for _, key in COLUMNS)
        lines.append(f"{mode:<12}{cells}")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollverify demo",
        description="Train the tiny CPU model with on-policy GRPO and with RollVerify (same seed, same steps, one "
        "shared SGLang server), then print a table of rewards, times, off-policy shift and acceptance, and "
        "draw a comparison plot. About 3 minutes on an idle 2-core machine; the first run also makes the tiny "
        "model (about a minute, then cached).",
        epilog="example: rollverify demo --modes on_policy partial rollverify --steps 20 seed=1",
    )
    p.add_argument("--config", default="tiny_cpu", help="YAML config or a shipped config's name (default tiny_cpu)")
    p.add_argument(
        "--out", default=None, help=f"folder for the runs and the plot (default {DEFAULT_OUT}, or the next free "
        f"{DEFAULT_OUT}-N)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the earlier demo that --out holds")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of each run (default 12)")
    p.add_argument(
        "--modes", nargs="+", default=list(MODES), help="algo.mode of each run; on_policy is the baseline "
        "(also: partial, staleness_filter, ops_filter)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides applied to every run")
    a = p.parse_args(argv)

    from rollverify.train import resolve_model, train
    from sglang_ext import cpu_compat
    from sglang_ext.launch import ServerStartError, launch_server

    base = [f"trainer.steps={a.steps}", *a.overrides]
    try:  # a bad mode, override, path or --out stops here, before a server starts or anything is written
        cfg0 = load_config(a.config, base)
        cfg0.check_paths()
        for mode in a.modes:
            load_config(a.config, [*base, f"algo.mode={mode}"])
        out = rundir.claim(a.out, overwrite=a.overwrite, demo=True) if a.out else rundir.next_free(DEFAULT_OUT)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quiet_cpu_warnings()
    say(f"demo: {', '.join(a.modes)}, {a.steps} steps each, into {out}")
    out.mkdir(parents=True, exist_ok=True)
    cpu_compat.activate()
    model = resolve_model(cfg0)
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    try:
        with stage("server") as st:
            server = launch_server(model, engine_args=dict(cfg0.rollout.engine_args), log_path=out / "server.log")
            st.detail = f"SGLang at {server.endpoint} (log: {out / 'server.log'})"
    except ServerStartError as e:
        print(f"error: the SGLang server did not start: {e}", file=sys.stderr)
        return 3
    with server:
        for mode in a.modes:
            cfg = load_config(a.config, [*base, f"algo.mode={mode}", f'rollout.endpoints=["{server.endpoint}"]'])
            say(f"{mode}: {a.steps} steps -> {out / mode}")
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
            say(f"{mode} mean step time = {fmt(speed, '.2f')} x on-policy's")
    say(f"total {time.perf_counter() - t0:.0f} s")
    (out / "demo.json").write_text(json.dumps(results, indent=1) + "\n")
    say(f"plots: {plot} and {out}/<mode>/plots/")
    say(f"run folder: {out} (one run folder per mode, demo.json, comparison.png)")
    return 0
