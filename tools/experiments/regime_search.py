"""Where does naive partial rollout lose accuracy? Run named settings x modes x seeds against one shared server.

    python tools/experiments/regime_search.py --out runs/regime --settings lr2e-4_ml256 lr5e-4_ml128 --seeds 100
    python tools/experiments/regime_search.py --out runs/regime --aggregate          # the table from what is there

A setting is a list of config overrides (SETTINGS below: every setting the search tried stays listed, so the
table can be rebuilt); a run is (setting, mode, seed) in OUT/<setting>/<mode>/s<seed>, skipped when its
summary.json exists. Modes whose trajectory does not depend on a setting's keys share one run: on-policy never
carries a token, so `rollout.max_live` and the stale-token corrections do not touch it (`SHARED_BY_ON_POLICY`),
and its runs are keyed by the remaining overrides only. Every run evaluates once, at its last step (512 x 2 by
default): the table gives, per setting and mode, the mean eval reward over the seeds, its standard error (over
seeds when there are two or more, else the evaluation's own over prompts), and on-policy minus partial in
standard errors of the difference. The server is started with room for the largest `max_live` of the grid.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

from rollverify.metrics import load_metrics

COMMON = ["log.plots=false", "log.tensorboard=false", "log.checkpoint_every=0", "log.export_final=false",
          "eval.every=0"]
SERVER = ["servers.engine_args.max_running_requests=256", "servers.engine_args.max_total_tokens=65536"]
MODES: dict[str, list[str]] = {
    "on_policy": ["algo.mode=on_policy"],
    "partial": ["algo.mode=partial"],
    "rollverify": ["algo.mode=rollverify"],
}
# keys that cannot change an on-policy trajectory (it carries nothing over): its run is shared across them
SHARED_BY_ON_POLICY = ("rollout.max_live", "trainer.correction.method", "trainer.correction.tis_cap")
SETTINGS: dict[str, list[str]] = {
    # the tiny default for reference (lr 5e-5, max_live 64, 40 steps)
    "base": [],
    # staleness (8x over-provisioning) and drift (4x lr)
    "lr2e-4_ml256": ["trainer.lr=2e-4", "rollout.max_live=256"],
    # no TIS: the trainer never corrects for the behaviour policy (its old log-probs are its own)
    "lr2e-4_ml256_notis": ["trainer.lr=2e-4", "rollout.max_live=256", "trainer.correction.method=none"],
    "lr5e-4_ml128": ["trainer.lr=5e-4", "rollout.max_live=128"],
    "lr5e-4_ml256_notis": ["trainer.lr=5e-4", "rollout.max_live=256", "trainer.correction.method=none"],
    "lr1e-3_ml256": ["trainer.lr=1e-3", "rollout.max_live=256"],
    "lr1e-3_ml256_notis": ["trainer.lr=1e-3", "rollout.max_live=256", "trainer.correction.method=none"],
    "lr2e-4_ml128_80steps": ["trainer.lr=2e-4", "rollout.max_live=128", "trainer.steps=80"],
}


def _key_of(overrides: list[str]) -> str:
    return overrides[0].split("=", 1)[0]


def run_dir(out: Path, setting: str, mode: str, seed: int) -> Path:
    """Where (setting, mode, seed) runs; on-policy runs live under the setting their trajectory depends on."""
    if mode == "on_policy":
        kept = [o for o in SETTINGS[setting] if _key_of([o]) not in SHARED_BY_ON_POLICY]
        name = next((s for s, o in SETTINGS.items() if o == kept), None) or "op_" + "_".join(kept).replace("=", "")
        return out / "_on_policy" / name / f"s{seed}"
    return out / setting / mode / f"s{seed}"


def figures(d: Path) -> dict | None:
    if not (d / "summary.json").exists():
        return None
    recs = load_metrics(d)
    ev = [r for r in recs if isinstance(r.get("eval_reward"), int | float)]
    k = max(1, len(recs) // 3)

    def mean(rs, key):
        v = [r[key] for r in rs if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        return statistics.fmean(v) if v else None

    return {
        "eval": ev[-1]["eval_reward"] if ev else None, "eval_se": ev[-1].get("eval_reward_se") if ev else None,
        "reward_last": mean(recs[-k:], "reward_mean"),
        "trained_ops": mean(recs, "trained_ops_mean"), "trained_ops_last": mean(recs[-k:], "trained_ops_mean"),
        "entropy_first": mean(recs[:k], "train/entropy"), "entropy_last": mean(recs[-k:], "train/entropy"),
        "staleness_max": max((r.get("staleness_max") or 0) for r in recs),
        "acceptance": mean(recs, "acceptance_rate"), "steps": len(recs),
        "wall_min": json.loads((d / "summary.json").read_text()).get("wall_s", 0) / 60,
    }


def table(out: Path, seeds: list[int], settings: list[str]) -> tuple[str, dict]:
    rows, data = [], {}
    head = ("| setting | on-policy eval | partial eval | RollVerify eval | on-policy - partial (in SE) | partial "
            "trained OPS (last third) | partial entropy first -> last | on-policy entropy first -> last | seeds |")
    rows += [head, "|---" * 9 + "|"]
    for s in settings:
        per = {m: [f for seed in seeds if (f := figures(run_dir(out, s, m, seed))) and f["eval"] is not None]
               for m in MODES}
        data[s] = per

        def stat(fs):
            if not fs:
                return None
            xs = [f["eval"] for f in fs]
            m = statistics.fmean(xs)
            se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else (fs[0]["eval_se"] or math.nan)
            return m, se, len(xs)

        st = {m: stat(fs) for m, fs in per.items()}
        cell = {m: (f"{v[0]:.3f} +- {v[1]:.3f} ({v[2]})" if v else "-") for m, v in st.items()}
        diff = "-"
        if st["on_policy"] and st["partial"]:
            d = st["on_policy"][0] - st["partial"][0]
            se = math.hypot(st["on_policy"][1], st["partial"][1])
            diff = f"{d:+.3f} ({d / se:+.1f})" if se > 0 else f"{d:+.3f}"

        def ent(fs):
            e = [(f["entropy_first"], f["entropy_last"]) for f in fs if f["entropy_first"] is not None]
            return f"{statistics.fmean(a for a, _ in e):.3f} -> {statistics.fmean(b for _, b in e):.3f}" if e else "-"

        ops = [f["trained_ops_last"] for f in per["partial"] if f["trained_ops_last"] is not None]
        rows.append(f"| {s} | {cell['on_policy']} | {cell['partial']} | {cell['rollverify']} | {diff} | "
                    f"{statistics.fmean(ops):.2e} | {ent(per['partial'])} | {ent(per['on_policy'])} | "
                    f"{min((len(v) for v in per.values() if v), default=0)} |" if ops else
                    f"| {s} | {cell['on_policy']} | {cell['partial']} | {cell['rollverify']} | {diff} | - | "
                    f"{ent(per['partial'])} | {ent(per['on_policy'])} | - |")
    return "\n".join(rows), data


def run_all(out: Path, todo: list[tuple[str, str, int]], extra: list[str], log: dict) -> None:
    from rollverify.app.config import load_config
    from rollverify.app.start import resolve_model
    from rollverify.app.train import train
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    base = load_config("tiny_cpu", [*COMMON, *SERVER, *extra])
    cpu_compat.activate()
    out.mkdir(parents=True, exist_ok=True)
    with launch_server(resolve_model(base), engine_args=base.servers.engine_args.args(),
                       log_path=out / "server.log") as server:
        for setting, mode, seed in todo:
            d = run_dir(out, setting, mode, seed)
            if (d / "summary.json").exists():
                continue
            cfg = load_config("tiny_cpu", [*COMMON, *SERVER, *SETTINGS[setting], *MODES[mode], *extra,
                                           f"seed={seed}", f"eval.every={_steps(setting, extra)}",
                                           f'servers.endpoints=["{server.endpoint}"]'])
            t0 = time.perf_counter()
            print(f"[regime] {setting} {mode} seed {seed} -> {d}", flush=True)
            try:
                train(cfg, d, progress=False, overwrite=d.exists())
                f = figures(d) or {}
                log["ran"].append([setting, mode, seed, round(time.perf_counter() - t0, 1)])
                print(f"[regime] {setting} {mode} seed {seed}: eval {f.get('eval')} +- {f.get('eval_se')} "
                      f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
            except Exception:  # one failed run must not stop the batch
                traceback.print_exc()
                log["failed"].append([setting, mode, seed])


def _steps(setting: str, extra: list[str]) -> int:
    for o in [*reversed(extra), *reversed(SETTINGS[setting])]:
        if o.startswith("trainer.steps="):
            return int(o.split("=", 1)[1])
    return 40


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["on_policy", "partial"])
    p.add_argument("--seeds", type=int, nargs="+", default=[100])
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--aggregate", action="store_true")
    a = p.parse_args(argv)
    log: dict = {"ran": [], "failed": []}
    if not a.aggregate:
        todo = [(s, m, seed) for seed in a.seeds for s in a.settings for m in a.modes]
        run_all(a.out, todo, a.overrides, log)
    text, data = table(a.out, a.seeds, a.settings)
    print(text)
    (a.out / "regime_table.md").write_text(text + "\n")
    (a.out / "regime_log.json").write_text(json.dumps({"seeds": a.seeds, "log": log, "data": data}, indent=1))
    return 1 if log["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
