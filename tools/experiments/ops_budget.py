"""What verification would cut from a run's carried responses, per (d_s, d_t) and with the auto thresholds: the
trade between tokens cut and off-policy shift removed, read from a checkpoint. (The drift by age itself, and the
sequence stage's what-if acceptance over a d_s grid, are logged every step under verify/drift/ and
verify/whatif/: rollverify/calibration.py.)

    python tools/experiments/ops_budget.py runs/seeds/s0/partial --json runs/seeds/s0/ops_budget.json

The run folder's checkpoint (checkpoint/: buffer.npz, loop.json, trainer/) holds the carried-over responses
with the engine's log-prob and policy version of every token; the run's own trainer, loaded at the checkpoint's
version, computes their new log-probs (as `algo.verify_on: trainer` does). Printed: the carried tokens' OPS by
staleness (share of tokens, mean OPS, share of the OPS mass), how concentrated the OPS mass is over tokens, and
for each (d_s, d_t) of a grid the share of carried tokens `two_stage_verify` cuts, the share of their OPS mass
it removes and the OPS mass per carried token that stays (a cut token is regenerated under the current policy,
at the engine/trainer floor); the last row is what `algo.d_s: auto, algo.d_t: auto` would set from this pool's
one-version tokens alone, and cut. One checkpoint is one verification of a pool nothing has cut before (a naive
partial run's): in a RollVerify run the pool is re-verified every step, so this is the trade's shape, not a
run's regeneration.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

D_S = (math.inf, 0.02, 0.01, 0.007, 0.005, 0.004, 0.003, 0.002)
D_T = (2.0, 0.5, 0.2, 0.1)


def carried_ops(run: Path) -> tuple[dict, list[np.ndarray], int]:
    """(arrays of the carried tokens: old/new log-probs, versions, lengths; per-token OPS), checkpoint version."""
    from megatron_bridge.loop_adapter import LoopTrainer
    from rollverify.app.config import RunConfig
    from rollverify.app.start import resolve_model, start_trainer
    from rollverify.buffer import RolloutBuffer
    from rollverify.verify import token_ops

    ckpt = run / "checkpoint"
    if not (ckpt / "loop.json").is_file():
        raise SystemExit(f"error: {run} has no checkpoint/loop.json (a run folder with log.checkpoint_every > 0)")
    cfg = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    version = int(json.loads((ckpt / "loop.json").read_text())["version"])
    carried = RolloutBuffer.load(ckpt / "buffer.npz").carried_over()
    if not carried:
        raise SystemExit(f"error: {run}'s checkpoint holds no carried-over responses")
    trainer = LoopTrainer(start_trainer(cfg, resolve_model(cfg)))
    trainer.load(str(ckpt / "trainer"))
    new = trainer.compute_logprobs(carried, cfg.rollout.temperature)
    x = {
        "old": np.concatenate([r.logprobs for r in carried]),
        "new": np.concatenate(new),
        "versions": np.concatenate([r.versions for r in carried]),
        "lengths": np.array([r.num_tokens for r in carried]),
    }
    x["ops"] = token_ops(torch.from_numpy(x["old"]), torch.from_numpy(x["new"])).numpy().astype(np.float64)
    return x, new, version


def budget(x: dict, version: int) -> dict:
    from rollverify.verify import two_stage_verify

    ops, n = x["ops"], len(x["ops"])
    mass = float(ops.sum())
    stale = version - x["versions"]
    out: dict = {
        "version": version,
        "responses": len(x["lengths"]),
        "tokens": n,
        "ops_mean": mass / n,
        "by_staleness": [
            {"staleness": int(s), "token_share": float((stale == s).mean()), "ops_mean": float(ops[stale == s].mean()),
             "mass_share": float(ops[stale == s].sum() / mass)}
            for s in np.unique(stale)
        ],
    }
    top = np.cumsum(np.sort(ops)[::-1]) / mass
    out["mass_in_top"] = {f"{f:g}": float(top[max(int(f * n), 1) - 1]) for f in (0.01, 0.05, 0.1, 0.2)}
    grid = []
    for d_s in D_S:
        for d_t in D_T:
            keep = two_stage_verify(x["old"], x["new"], x["versions"], x["lengths"], d_s, d_t).keep_lengths.numpy()
            kept = np.concatenate([np.arange(m) < k for m, k in zip(x["lengths"], keep, strict=True)])
            kept_mass = float(ops[kept].sum())
            grid.append({"d_s": d_s, "d_t": d_t, "tokens_cut": 1 - float(kept.mean()),
                         "mass_cut": 1 - kept_mass / mass, "ops_per_token_kept": kept_mass / n,
                         "reduction": mass / kept_mass if kept_mass > 0 else math.inf})
    from rollverify.calibration import AutoThresholds

    t = AutoThresholds().update(torch.from_numpy(ops).float(), torch.from_numpy(x["versions"]), version)
    if not t.warmup:
        keep = two_stage_verify(x["old"], x["new"], x["versions"], x["lengths"], t.d_s, t.d_t,
                                seq_margin=t.seq_margin).keep_lengths.numpy()
        kept = np.concatenate([np.arange(m) < k for m, k in zip(x["lengths"], keep, strict=True)])
        kept_mass = float(ops[kept].sum())
        grid.append({"d_s": t.d_s, "d_t": t.d_t, "seq_margin": t.seq_margin, "auto": True,
                     "tokens_cut": 1 - float(kept.mean()), "mass_cut": 1 - kept_mass / mass,
                     "ops_per_token_kept": kept_mass / n, "reduction": mass / kept_mass if kept_mass > 0 else math.inf})
    out["grid"] = grid
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder with a checkpoint (best a naive partial run's)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    x, _, version = carried_ops(a.run)
    b = budget(x, version)
    print(f"{a.run}: version {version}, {b['responses']} carried responses, {b['tokens']} tokens, "
          f"mean OPS {b['ops_mean']:.2e}")
    print("staleness  token share  mean OPS  OPS mass share")
    for s in b["by_staleness"]:
        print(f"{s['staleness']:>9}  {s['token_share']:>11.2f}  {s['ops_mean']:>8.2e}  {s['mass_share']:>14.2f}")
    print("OPS mass held by the top tokens: " + ", ".join(f"{float(f):.0%}: {v:.2f}" for f, v in b["mass_in_top"].items()))
    print(f"{'d_s':>6} {'d_t':>5} {'tokens cut':>11} {'OPS mass cut':>13} {'OPS/token kept':>15} {'reduction':>10}")
    for g in b["grid"]:
        print(f"{g['d_s']:>6.3g} {g['d_t']:>5.3g} {g['tokens_cut']:>11.2f} {g['mass_cut']:>13.2f} "
              f"{g['ops_per_token_kept']:>15.2e} {g['reduction']:>9.1f}x" + ("  (auto)" if g.get("auto") else ""))
    if a.json:
        a.json.write_text(json.dumps(b, indent=1) + "\n")
        print(f"written: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
