"""Trainer/engine log-prob mismatch over weight updates, with and without routing replay (the table of docs/results.md).

    python tools/experiments/replay_mismatch.py --out runs/replay_mismatch [--settings tiny_moe a3b_layer ...] [--steps 4]

Each setting is one `rollverify train` of `--steps` steps (rollverify mode, lr 1e-4 unless the setting says,
the tail carried over every step, a reward that varies with the response so that every step moves the
weights, random weights at the given per-layer shape, float32) on its own SGLang server. Per step it reports
`train/mismatch_abs_max` / `_mean` (tokens sampled by the weights the trainer holds: engine and trainer should
agree to the kernels' floor), `train/drift_abs_mean` (older, carried tokens: the policy's drift since) and the
carried and kept token counts; it prints one table and writes `OUT/replay_mismatch.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def score(prompt: str, response: str, label: object) -> float:
    """The runs' reward (`task.reward` points at this file): it varies with the response, so that every step moves
    the untrained weights (the countdown reward would be 0 everywhere); the end-to-end tests' reward is the same."""
    return float(sum(map(ord, response)) % 7) / 6.0


REWARD = f"{Path(__file__).resolve()}:score"
# its 0.8 GB of float32 weights need SGLang's static share of this machine's memory above the default 0.05
A3B = ("model.tiny_overrides={hidden_size: 2048, num_heads: 32, num_kv_heads: 4, head_dim: 128, "
       "moe_intermediate_size: 768, intermediate_size: 768, num_experts: 16, top_k: 8}",
       "servers.engine_args.mem_fraction_static=0.15")
DENSE_06B = ("model.tiny_overrides={hidden_size: 1024, num_heads: 16, num_kv_heads: 8, head_dim: 128, "
             "intermediate_size: 3072}")
BASE = [
    "model.task=null", f"task.reward={REWARD}", "algo.mode=rollverify", "rollout.batch_groups=2", "rollout.n=4",
    "rollout.max_new_tokens=64", "rollout.max_live=16", "trainer.lr=1e-4", "eval.every=0", "log.plots=false",
    "log.tensorboard=false", "log.export_final=false", "log.checkpoint_every=0",
]
# name -> (what it is, overrides)
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "tiny_moe": ("tiny MoE (8 experts, top-2), replay on", ["model.moe=true"]),
    "tiny_moe_no_replay": ("tiny MoE, trainer.replay_train=false", ["model.moe=true", "trainer.replay_train=false"]),
    "tiny_moe_engine": ("tiny MoE, replay on, algo.verify_on=engine", ["model.moe=true", "algo.verify_on=engine"]),
    "a3b_layer": ("Qwen3-30B-A3B layer (16 experts, top-8), replay on", ["model.moe=true", *A3B]),
    "a3b_layer_no_replay": ("Qwen3-30B-A3B layer, trainer.replay_train=false",
                            ["model.moe=true", *A3B, "trainer.replay_train=false"]),
    "dense_06b_layer": ("dense, Qwen3-0.6B layer", [DENSE_06B]),
    "dense_06b_layer_lr1e-6": ("dense, Qwen3-0.6B layer, lr 1e-6 (carried prefixes survive)",
                               [DENSE_06B, "trainer.lr=1e-6"]),
}
KEYS = ("train/mismatch_abs_max", "train/mismatch_abs_mean", "train/mismatch_tokens", "train/drift_abs_mean",
        "train/drift_abs_max", "train/drift_tokens", "verify/kept_tokens", "n_carried")


def run_setting(name: str, out: Path, steps: int) -> list[dict]:
    from rollverify.app.config import load_config
    from rollverify.app.train import train

    cfg = load_config(None, [*BASE, *SETTINGS[name][1], f"trainer.steps={steps}"])
    train(cfg, out / name, progress=False)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in rows]


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the runs and replay_mismatch.json")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.settings:
        results[name] = {"what": SETTINGS[name][0], "steps": run_setting(name, a.out, a.steps)}
        print(f"\n{name}: {SETTINGS[name][0]}")
        print("step " + " ".join(f"{k.split('/')[-1]:>18}" for k in KEYS))
        for row in results[name]["steps"]:
            print(f"{row['step']:>4} " + " ".join(f"{_fmt(row[k]):>18}" for k in KEYS))
        (a.out / "replay_mismatch.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
