"""`rollverify demo` (what `make demo` runs): on-policy GRPO and RollVerify side by side on the tiny CPU default.

Both runs share one SGLang server (each run first pushes its trainer's initial weights to it), use the same
seed and the same number of steps, and write their own run folder under the demo's folder; a table and a
comparison plot follow, then the verdict: each mode's priced rollout cost against on-policy's (decode iterations
plus generated and prefilled tokens in iteration-equivalents, rollverify/pricing.py: what a GPU's time would
follow) as a ratio with its 95 % interval over the steps, beside the decode iterations alone and the tokens
generated per token trained, and the eval rewards with their intervals over the held-out prompts. Wall time is
this machine's and only in the table. One seed is one sample: the claims of docs/results.md rest on several
(tools/experiments/compare_seeds.py, tools/experiments/settle.py). Without --out the demo writes to runs/demo,
or runs/demo-2, -3, ... when that holds an earlier demo; an explicit --out that holds one is refused unless
--overwrite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from rollverify.app import rundir
from rollverify.app.config import load_config
from rollverify.app.console import fmt, quiet_cpu_warnings, say, stage
from rollverify.app.evaluate import format_interval
from rollverify.metrics import load_metrics, plot_comparison
from rollverify.pricing import run_cost

MODES = ("on_policy", "rollverify")
STALE_MODES = ("on_policy", "partial", "rollverify")  # --stale: the three of the paper's Table 2
DEFAULT_OUT = "runs/demo"
COLUMNS = (
    ("final train reward", "reward_last"),
    ("eval reward", "eval_last"),  # +- 1.96 standard errors over the eval prompts where known
    ("priced iters/step", "priced"),  # rollverify/pricing.py
    ("decode iters/step", "decode_iters"),
    ("generated/trained", "generated_per_trained"),
    ("wall s", "wall_s"),
    ("step s", "step_s"),
    ("mean OPS (carried)", "ops_mean"),
    ("trained OPS", "trained_ops_mean"),
    ("acceptance", "acceptance_rate"),
)
TOOL_COLUMNS = (  # a multi-turn run's (`--tools`)
    ("tool s/step", "tool_s"),
    ("turns (mean)", "turns_mean"),
    ("env token share", "env_share"),
)


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def _mean(rows: list[dict], key: str) -> float:
    vals = _values(rows, key)
    return sum(vals) / len(vals) if vals else float("nan")


def _se(rows: list[dict], key: str) -> float:
    """Standard error of the per-step mean of `key` (NaN with fewer than 2 steps)."""
    vals = _values(rows, key)
    if len(vals) < 2:
        return float("nan")
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1) / len(vals))


def ratio_interval(a: float, a_se: float, b: float, b_se: float, z: float = 1.96) -> tuple[float, float, float]:
    """a / b and its z-standard-error interval (delta method: independent a and b, relative errors add in
    quadrature)."""
    r = a / b
    half = z * abs(r) * math.sqrt((a_se / a) ** 2 + (b_se / b) ** 2)
    return r, r - half, r + half


def verdict(results: dict[str, dict], baseline: str = "on_policy") -> list[str]:
    """One line per mode against the baseline: the priced cost per step as a ratio with its 95 % interval over the
    steps (decode iterations alone and the tokens generated per token trained beside it), and the eval reward
    with its interval over the prompts and the difference's."""
    base = results[baseline]
    lines = []
    for mode in [m for m in results if m != baseline]:
        r = results[mode]
        parts = []
        q, lo, hi = ratio_interval(r.get("priced", math.nan), r.get("priced_se", 0.0), base.get("priced", math.nan),
                                   base.get("priced_se", 0.0))
        it = r["decode_iters"] / base["decode_iters"] if base.get("decode_iters") else math.nan
        parts.append(f"priced cost {fmt(q, '.2f')}x [{fmt(lo, '.2f')}, {fmt(hi, '.2f')}] (decode iterations "
                     f"{fmt(it, '.2f')}x, tokens generated per trained {fmt(r.get('generated_per_trained'), '.2f')} vs "
                     f"{fmt(base.get('generated_per_trained'), '.2f')})")
        ev, ev_se = r.get("eval_last", math.nan), r.get("eval_se", math.nan)
        bev, bev_se = base.get("eval_last", math.nan), base.get("eval_se", math.nan)
        if math.isfinite(ev) and math.isfinite(bev):
            d, d_se = ev - bev, math.sqrt(ev_se**2 + bev_se**2)
            within = "within the noise" if abs(d) <= 1.96 * d_se else "above" if d > 0 else "below"
            parts.append(
                f"eval reward {format_interval(ev, ev_se)} vs {format_interval(bev, bev_se)}: "
                f"difference {d:+.3f} +- {1.96 * d_se:.3f} ({within})"
            )
        lines.append(f"{mode} / {baseline}: " + "; ".join(parts))
    return lines


def _last(rows: list[dict], key: str, n: int = 5) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return sum(vals[-n:]) / len(vals[-n:]) if vals else float("nan")


def _cell(r: dict, key: str) -> str:
    se = r.get("eval_se") if key == "eval_last" else None
    if isinstance(se, float) and math.isfinite(se) and math.isfinite(r.get(key, math.nan)):
        return f"{r[key]:.3f}+-{1.96 * se:.3f}"
    return fmt(r.get(key), ".3f")


def table(results: dict[str, dict]) -> str:
    """One row per mode; `-` where a figure does not apply (no carried responses under on_policy, no eval)."""
    columns = COLUMNS + (TOOL_COLUMNS if any("tool_s" in r for r in results.values()) else ())
    head = f"{'mode':<12}" + "".join(f"{name:>20}" for name, _ in columns)
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        cells = "".join(f"{_cell(r, key):>20}" for _, key in columns)
        lines.append(f"{mode:<12}{cells}")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollverify demo",
        description="Train the tiny CPU model with on-policy GRPO and with RollVerify (same seed, same steps, one "
        "shared SGLang server), then print a table of rewards, times, off-policy shift and acceptance, and "
        "draw a comparison plot. About 3 minutes on an idle 2-core machine for the training, plus one evaluation "
        "of 512 prompts x 2 samples per run at its last step (about as many tokens as the training's rollouts); "
        "the first run also makes the tiny model (about a minute, then cached).",
        epilog="example: rollverify demo --modes on_policy partial rollverify --steps 20 seed=1",
    )
    p.add_argument("--config", default=None, help="YAML config or a shipped config's name (default tiny_cpu)")
    p.add_argument("--tools", action="store_true", help="multi-turn tool use: the tool task of configs/tiny_tools.yaml "
                   "(a trajectory calls the `next` tool once per turn; its outputs are environment tokens)")
    p.add_argument(
        "--out", default=None, help=f"folder for the runs and the plot (default {DEFAULT_OUT}, or the next free "
        f"{DEFAULT_OUT}-N)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the earlier demo that --out holds")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of each run (default 12; --stale: 40)")
    p.add_argument("--stale", action="store_true",
                   help="the setting where naive partial rollout loses accuracy (configs/tiny_stale.yaml: "
                   "lr 1e-3, no TIS, max_live 256): on_policy, partial and rollverify, 40 steps each, unless --config, "
                   "--modes or --steps say otherwise")
    p.add_argument(
        "--modes", nargs="+", default=None, help="algo.mode of each run; on_policy is the baseline "
        "(default: on_policy rollverify; also: partial, staleness_filter, ops_filter, spec_rl)"
    )
    p.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                   help="seconds the SGLang server may take to start (default 300; more on a loaded machine)")
    p.add_argument("--eval-modes", nargs="+", default=None, metavar="MODE",
                   help="the modes evaluated at the last step (default: every mode); the others run with "
                   "eval.every=0, e.g. partial when only its OPS is compared")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides applied to every run")
    a = p.parse_args(argv)
    if a.tools and a.stale:
        print("error: --tools and --stale are two different settings; pass one", file=sys.stderr)
        return 2
    if a.config is None:
        a.config = "tiny_tools" if a.tools else "tiny_stale" if a.stale else "tiny_cpu"
    a.modes = a.modes or (list(STALE_MODES) if a.stale else list(MODES))
    a.steps = (40 if a.stale else 12) if a.steps is None else a.steps

    from rollverify.app.start import resolve_model
    from rollverify.app.train import train
    from sglang_ext import cpu_compat
    from sglang_ext.launch import ServerStartError, launch_server

    # one evaluation, at the last step: at the default 512 prompts x 2 samples it costs about as much as a few
    # steps, and the verdict compares the last one (an override of eval.every still applies)
    base = [f"trainer.steps={a.steps}", f"eval.every={a.steps}", *a.overrides]
    eval_modes = set(a.modes if a.eval_modes is None else a.eval_modes)

    def overrides(mode: str) -> list[str]:
        return [*base, f"algo.mode={mode}", *([] if mode in eval_modes else ["eval.every=0"])]

    try:  # a bad mode, override, path or --out stops here, before a server starts or anything is written
        if not eval_modes <= set(a.modes):
            raise ValueError(f"--eval-modes {' '.join(sorted(eval_modes - set(a.modes)))}: not among --modes "
                             f"{' '.join(a.modes)}")
        cfg0 = load_config(a.config, base)
        cfg0.check_paths()
        for mode in a.modes:
            load_config(a.config, overrides(mode))
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
            server = launch_server(model, engine_args=cfg0.servers.engine_args.args(), log_path=out / "server.log",
                                   startup_timeout_s=a.start_timeout)
            st.detail = f"SGLang at {server.endpoint} (log: {out / 'server.log'})"
    except ServerStartError as e:
        print(f"error: the SGLang server did not start: {e}", file=sys.stderr)
        return 3
    with server:
        for mode in a.modes:
            cfg = load_config(a.config, [*overrides(mode), f'servers.endpoints=["{server.endpoint}"]'])
            say(f"{mode}: {a.steps} steps -> {out / mode}")
            summary = train(cfg, out / mode, progress=True)
            rows = load_metrics(out / mode)
            ledger = summary.get("ledger", {})
            results[mode] = {
                "reward_last": _last(rows, "reward_mean"),
                "eval_last": _last(rows, "eval_reward", 1),
                "eval_se": _last(rows, "eval_reward_se", 1),
                "wall_s": float(summary.get("wall_s", float("nan"))),
                "decode_iters": _mean(rows, "decode_iters"),
                "decode_iters_se": _se(rows, "decode_iters"),
                "rollout_s": _mean(rows, "rollout_s"),
                "step_s": _mean(rows, "step_s"),
                "step_s_se": _se(rows, "step_s"),
                "tokens_generated": float(ledger.get("generated_tokens", float("nan"))),
                "tokens_trained": float(ledger.get("trained_tokens", float("nan"))),
                **{k: math.nan if v is None else v for k, v in run_cost(rows, ledger).items()},
                "ops_mean": _mean(rows, "ops_mean"),
                "trained_ops_mean": _mean(rows, "trained_ops_mean"),
                "acceptance_rate": _mean(rows, "acceptance_rate"),
            }
            if any("tools/calls" in r for r in rows):
                results[mode].update(tool_s=_mean(rows, "tools/tool_s_sum"), turns_mean=_mean(rows, "tools/turns_mean"),
                                     env_share=_mean(rows, "tools/env_token_share"))
    plot = plot_comparison({m: out / m for m in a.modes}, out / "comparison.png")
    print()
    print(table(results))
    print()
    if "on_policy" in results:
        say("verdict (one seed; 95 % intervals over the steps and the eval prompts; the priced cost is decode "
            "iterations plus generated and prefilled tokens in iteration-equivalents, what rollout time follows on a "
            "GPU (rollverify/pricing.py); wall time is this machine's):")
        for line in verdict(results):
            say(f"  {line}")
    say(f"total {time.perf_counter() - t0:.0f} s")
    (out / "demo.json").write_text(json.dumps(results, indent=1) + "\n")
    say(f"plots: {plot} and {out}/<mode>/plots/")
    say(f"run folder: {out} (one run folder per mode, demo.json, comparison.png)")
    return 0
