"""The settling experiment: does verification at a fair tightness keep partial rollout's speed and on-policy's
accuracy where partial rollout loses accuracy? (docs/results.md, "Current results"; docs/verification.md)

    python tools/experiments/settle.py screen --out runs/settle
        # seed 100: partial at lr 1e-3 x max_live {48, 64, 256} x TIS {on, off}, on-policy
    python tools/experiments/settle.py calibrate --out runs/settle --setting ml64_tis  # seed 100: auto thresholds
    python tools/experiments/settle.py seeds --out runs/settle --setting ml64_tis      # seeds 101-105 x five modes
    python tools/experiments/settle.py table --out runs/settle --setting ml64_tis      # the tables from what is there

Every run is `configs/tiny_stale.yaml` (lr 1e-3, 40 steps) with the setting's `rollout.max_live` and
`trainer.correction.method` (tis or none), one evaluation at step 40 (512 prompts x 2) and the initial model's evaluation on the same
seed's prompts (the step-0 eval: OUT/step0/s<seed>.json, once per seed). A run is OUT/<setting>/<mode>/s<seed>
(on-policy's OUT/_on_policy/s<seed>, shared by every setting), skipped when its summary.json exists; every run of an invocation shares one SGLang server. The screen keeps
checkpoints (every 10 steps). The table gives per seed and mode the eval reward, acceptance, generated tokens per
trained token, decode iterations and the priced cost (rollverify/pricing.py) per step; the means over seeds with
standard errors, the differences to on-policy and to partial with paired standard errors, and which outcome of
the experiment's table occurred.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from rollverify.metrics import load_metrics
from rollverify.pricing import run_cost

CONFIG = "tiny_stale"
COMMON = ["log.plots=false", "log.tensorboard=false", "log.export_final=false", "trainer.steps=40", "eval.every=40"]
SCREEN_SEED = 100
SEEDS = (101, 102, 103, 104, 105)
SETTINGS: dict[str, list[str]] = {  # over tiny_stale (lr 1e-3, max_live 256, no TIS)
    f"ml{ml}_{'tis' if tis else 'notis'}": [f"rollout.max_live={ml}", f"trainer.correction.method={'tis' if tis else 'none'}"]
    for ml in (48, 64, 256) for tis in (True, False)
}
MODES: dict[str, list[str]] = {
    "on_policy": ["algo.mode=on_policy"],
    "partial": ["algo.mode=partial"],
    "rv_auto": ["algo.mode=rollverify", "algo.d_s=auto", "algo.d_t=auto", "algo.conditional_switch=false"],
    "rv_auto_switch": ["algo.mode=rollverify", "algo.d_s=auto", "algo.d_t=auto", "algo.conditional_switch=true"],
    # the restart control: a carried response restarts from its prompt (no stale token is ever trained)
    "restart": ["algo.mode=staleness_filter", "algo.staleness_s=0"],
}
LABELS = {"on_policy": "on-policy", "partial": "partial", "rv_auto": "RollVerify auto, switch off",
          "rv_auto_switch": "RollVerify auto, switch on", "restart": "restart control (staleness_filter S=0)"}


def run_dir(out: Path, setting: str, mode: str, seed: int) -> Path:
    """OUT/<setting>/<mode>/s<seed>; on-policy's under OUT/_on_policy: it carries nothing over, so neither
    `rollout.max_live` nor TIS (whose weight on a token of the trainer's own weights is the fp32 floor's 1 +- 3e-7)
    changes its run, and every setting shares it."""
    if mode == "on_policy":
        return out / "_on_policy" / f"s{seed}"
    return out / setting / mode / f"s{seed}"


def figures(d: Path) -> dict | None:
    """One finished run's figures, or None."""
    if not (d / "summary.json").exists():
        return None
    recs = load_metrics(d)
    summary = json.loads((d / "summary.json").read_text())
    ev = [r for r in recs if isinstance(r.get("eval_reward"), int | float)]
    k = max(1, len(recs) // 3)

    def mean(rs, key):
        v = [r[key] for r in rs if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        return statistics.fmean(v) if v else None

    cost = run_cost(recs, summary.get("ledger"))
    return {
        "eval": ev[-1]["eval_reward"] if ev else None, "eval_se": ev[-1].get("eval_reward_se") if ev else None,
        "reward_first": mean(recs[:k], "reward_mean"), "reward_last": mean(recs[-k:], "reward_mean"),
        "trained_ops": mean(recs, "trained_ops_mean"), "carried_ops": mean(recs, "ops_mean"),
        "entropy_last": mean(recs[-k:], "train/entropy"), "length_last": mean(recs[-k:], "response_length_mean"),
        "acceptance": mean(recs, "acceptance_rate"),
        "switched_at": next((r["step"] for r in recs if r.get("switched")), None),
        "d_s": mean(recs, "verify/d_s"), "d_t": mean(recs, "verify/d_t"), "delta1": mean(recs, "verify/auto_delta1"),
        "age1_ops": mean(recs, "verify/drift/age1_ops_mean"), "age2_ops": mean(recs, "verify/drift/age2_ops_mean"),
        "age3p_ops": mean(recs, "verify/drift/age3p_ops_mean"), "age1_p999": mean(recs, "verify/drift/age1_ops_p999"),
        "steps": len(recs), "wall_min": summary.get("wall_s", 0) / 60, **cost,
    }


def step0(out: Path, seed: int) -> dict | None:
    p = out / "step0" / f"s{seed}.json"
    return json.loads(p.read_text()) if p.exists() else None


def run_all(out: Path, todo: list[tuple[str, str, int]], extra: list[str], step0_evals: bool = True) -> list:
    """Every (setting, mode, seed) without a summary.json, and each seed's step-0 evaluation, on one server."""
    from rollverify.app.config import load_config
    from rollverify.app.evaluate import evaluate_checkpoint
    from rollverify.app.start import resolve_model
    from rollverify.app.train import train
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    failed = []
    seeds = sorted({s for *_, s in todo})
    todo = [t for t in todo if not (run_dir(out, *t) / "summary.json").exists()]
    if not step0_evals:
        seeds = []
    if not todo and all(step0(out, s) is not None for s in seeds):
        return failed
    base = load_config(CONFIG, [*COMMON, *extra])
    cpu_compat.activate()
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(base)
    log = out / "logs" / f"server-{os.getpid()}.log"  # one per invocation: batches may run side by side
    log.parent.mkdir(parents=True, exist_ok=True)
    with launch_server(model, engine_args=base.servers.engine_args.args(), log_path=log,
                       startup_timeout_s=1800) as server:
        endpoint = f'servers.endpoints=["{server.endpoint}"]'
        for setting, mode, seed in todo:
            d = run_dir(out, setting, mode, seed)
            t0 = time.perf_counter()
            print(f"[settle] {setting} {mode} seed {seed} -> {d}", flush=True)
            try:
                cfg = load_config(CONFIG, [*COMMON, *SETTINGS[setting], *MODES[mode], *extra, f"seed={seed}",
                                           endpoint])
                train(cfg, d, progress=False, overwrite=d.exists())
                f = figures(d) or {}
                print(f"[settle] {setting} {mode} seed {seed}: eval {f.get('eval')} acceptance {f.get('acceptance')} "
                      f"priced {f.get('priced')} ({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
            except Exception:  # one failed run must not stop the batch: reported, rerun next time
                traceback.print_exc()
                failed.append([setting, mode, seed])
        for seed in seeds:  # after the runs: what the runs decide does not wait for them
            if step0(out, seed) is None:
                print(f"[settle] step-0 eval seed {seed}", flush=True)
                try:
                    evaluate_checkpoint(load_config(CONFIG, [*COMMON, *extra, f"seed={seed}", endpoint]), model,
                                        out / "step0" / f"s{seed}.json")
                except Exception:
                    traceback.print_exc()
                    failed.append(["step0", seed])
    return failed


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def screen_table(out: Path) -> str:
    """The screen: per setting, partial's eval against on-policy's (seed 100), drift and cost."""
    op = figures(run_dir(out, "ml64_tis", "on_policy", SCREEN_SEED)) or {}
    s0 = step0(out, SCREEN_SEED) or {}
    rows = [f"step-0 eval (seed {SCREEN_SEED}): {_f(s0.get('eval_reward'))} +- {_f(s0.get('eval_reward_se'))}; "
            f"on-policy at step 40: {_f(op.get('eval'))} +- {_f(op.get('eval_se'))}", "",
            "| setting | partial eval (SE) | - on-policy | train reward first -> last third | trained OPS | carried "
            "OPS | one-version OPS (age 1) | age 2 | age 3+ | age-1 p99.9 | generated / trained | decode iters/step "
            "| priced iters/step |", "|---" * 13 + "|"]
    for s in SETTINGS:
        f = figures(run_dir(out, s, "partial", SCREEN_SEED))
        if f is None:
            rows.append(f"| {s} | not run |" + " |" * 11)
            continue
        diff = f["eval"] - op["eval"] if f.get("eval") is not None and op.get("eval") is not None else None
        rows.append(f"| {s} | {_f(f['eval'])} ({_f(f['eval_se'])}) | {_f(diff, '+.3f')} | {_f(f['reward_first'])} -> "
                    f"{_f(f['reward_last'])} | {_f(f['trained_ops'], '.3g')} | {_f(f['carried_ops'], '.3g')} | "
                    f"{_f(f['age1_ops'], '.3g')} | {_f(f['age2_ops'], '.3g')} | {_f(f['age3p_ops'], '.3g')} | "
                    f"{_f(f['age1_p999'], '.3g')} | {_f(f['generated_per_trained'], '.2f')} | "
                    f"{_f(f['decode_iters'], '.1f')} | {_f(f['priced'], '.1f')} |")
    return "\n".join(rows)


def _paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean difference a - b over seeds and its paired standard error."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.fmean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan)


def seeds_table(out: Path, setting: str, seeds: list[int]) -> tuple[str, dict]:
    per = {m: {s: figures(run_dir(out, setting, m, s)) for s in seeds} for m in MODES}
    done = [s for s in seeds if all(per[m][s] and per[m][s]["eval"] is not None for m in MODES)]
    lines = [f"Setting {setting} (tiny_stale with {' '.join(SETTINGS[setting])}); seeds with every mode: {done}", "",
             "| seed | step-0 eval | " + " | ".join(LABELS[m] for m in MODES) + " |", "|---" * (len(MODES) + 2) + "|"]
    for s in seeds:
        s0 = step0(out, s) or {}
        cells = [_f(per[m][s]["eval"]) if per[m][s] else "-" for m in MODES]
        lines.append(f"| {s} | {_f(s0.get('eval_reward'))} | " + " | ".join(cells) + " |")
    summary: dict = {"setting": setting, "seeds": done, "modes": {}}
    lines += ["", "| mode | eval mean +- SE | - on-policy (paired SE) | - partial (paired SE) | acceptance | switched at "
              "| generated / trained | decode iters/step | prefill tokens/step | priced iters/step | priced / "
              "on-policy | trained OPS |", "|---" * 12 + "|"]
    if not done:
        return "\n".join(lines), summary

    def vals(m, key):
        return [per[m][s][key] for s in done]

    op_priced = statistics.fmean(vals("on_policy", "priced")) if all(v is not None for v in vals("on_policy", "priced")) \
        else None
    for m in MODES:
        ev = vals(m, "eval")
        mean, se = statistics.fmean(ev), (statistics.stdev(ev) / math.sqrt(len(ev)) if len(ev) > 1 else math.nan)
        d_op, se_op = _paired(ev, vals("on_policy", "eval"))
        d_p, se_p = _paired(ev, vals("partial", "eval"))

        def avg(key, m=m):
            v = [x for x in vals(m, key) if x is not None]
            return statistics.fmean(v) if v else None

        priced = avg("priced")
        ratio = priced / op_priced if priced is not None and op_priced else None
        switches = [x for x in vals(m, "switched_at") if x is not None]
        row = {"eval": mean, "eval_se": se, "minus_on_policy": d_op, "minus_on_policy_se": se_op, "minus_partial": d_p,
               "minus_partial_se": se_p, "acceptance": avg("acceptance"), "generated_per_trained":
               avg("generated_per_trained"), "decode_iters": avg("decode_iters"), "prefill_tokens":
               avg("prefill_tokens"), "priced": priced, "priced_ratio": ratio, "trained_ops": avg("trained_ops"),
               "switched": switches, "d_s": avg("d_s"), "d_t": avg("d_t"), "delta1": avg("delta1")}
        summary["modes"][m] = row
        lines.append(f"| {LABELS[m]} | {mean:.3f} +- {se:.3f} | {d_op:+.3f} ({se_op:.3f}) | {d_p:+.3f} ({se_p:.3f}) "
                     f"| {_f(row['acceptance'])} | {switches or '-'} | {_f(row['generated_per_trained'], '.2f')} | "
                     f"{_f(row['decode_iters'], '.1f')} | {_f(row['prefill_tokens'], '.0f')} | {_f(priced, '.1f')} | "
                     f"{_f(ratio, '.2f')} | {_f(row['trained_ops'], '.3g')} |")
    summary["outcome"] = outcome(summary["modes"])
    lines += ["", "Outcome: " + "; ".join(summary["outcome"]) if summary["outcome"] else "Outcome: none of the table's"]
    return "\n".join(lines), summary


def outcome(modes: dict) -> list[str]:
    """Which rows of the experiment's outcome table hold, for each RollVerify variant and the restart control."""
    out = []
    op, part = modes["on_policy"], modes["partial"]
    partial_loses = part["eval"] < op["eval"] - 2 * (part["minus_on_policy_se"] or 0)
    for m in ("rv_auto", "rv_auto_switch"):
        r = modes[m]
        close = abs(r["minus_on_policy"]) <= r["minus_on_policy_se"] * 1.0 + 1e-12 or r["minus_on_policy"] >= 0
        above = r["minus_partial"] >= 3 * r["minus_partial_se"]
        acc, ratio = r["acceptance"] or 0.0, r["priced_ratio"]
        if close and above and acc >= 0.7 and ratio is not None and ratio <= 0.6:
            out.append(f"{LABELS[m]}: the claim reproduces")
        elif close and above and acc < 0.5:
            out.append(f"{LABELS[m]}: accuracy only with acceptance < 0.5 (on-policy's cost at a fair threshold)")
        elif partial_loses and r["minus_partial"] < 2 * r["minus_partial_se"]:
            out.append(f"{LABELS[m]}: collapses with partial (no protection at a fair tightness)")
        else:
            out.append(f"{LABELS[m]}: eval {r['eval']:.3f}, {r['minus_on_policy']:+.3f} vs on-policy "
                       f"({r['minus_on_policy_se']:.3f}), {r['minus_partial']:+.3f} vs partial "
                       f"({r['minus_partial_se']:.3f}), acceptance {acc:.2f}, priced {_f(ratio, '.2f')}x: "
                       "no row of the table")
    rc = modes["restart"]
    if partial_loses and rc["minus_partial"] < 2 * rc["minus_partial_se"]:
        out.append("the restart control collapses too: the harm is not stale tokens")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["screen", "calibrate", "seeds", "table"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--setting", choices=list(SETTINGS), default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-step0", action="store_true",
                   help="skip the step-0 evaluations (every seed starts from the same warm-started model, so one "
                        "seed's measures the start; the others differ only in sampling)")
    a = p.parse_args(argv)
    failed: list = []
    if a.phase == "screen":
        todo = [("ml64_tis", "on_policy", SCREEN_SEED)] + [(s, "partial", SCREEN_SEED) for s in SETTINGS]
        failed = run_all(a.out, todo, ["log.checkpoint_every=10", *a.overrides])
    elif a.phase in ("calibrate", "seeds", "table") and a.setting is None:
        p.error(f"{a.phase} needs --setting (the screen's choice)")
    elif a.phase == "calibrate":
        failed = run_all(a.out, [(a.setting, "rv_auto", SCREEN_SEED)], a.overrides)
    elif a.phase == "seeds":
        failed = run_all(a.out, [(a.setting, m, s) for s in a.seeds for m in a.modes], a.overrides,
                         step0_evals=not a.no_step0)
    text = screen_table(a.out)
    if a.setting is not None:
        cal = figures(run_dir(a.out, a.setting, "rv_auto", SCREEN_SEED))
        if cal:
            text += (f"\n\nCalibration ({a.setting}, seed {SCREEN_SEED}, RollVerify auto, switch off): d_s mean "
                     f"{_f(cal['d_s'], '.3g')}, d_t mean {_f(cal['d_t'], '.3g')} from one-version drift "
                     f"{_f(cal['delta1'], '.3g')}; acceptance {_f(cal['acceptance'])}, eval {_f(cal['eval'])}, "
                     f"generated / trained {_f(cal['generated_per_trained'], '.2f')}, priced {_f(cal['priced'], '.1f')}")
        seeds_text, summary = seeds_table(a.out, a.setting, a.seeds)
        text += "\n\n" + seeds_text
        (a.out / "settle.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "settle.md").write_text(text + "\n")
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
