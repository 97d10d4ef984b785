"""Routing replay across resumes, end to end: a real SGLang MoE server and the real Megatron-Core trainer.

Every position the trainer recomputes replays the routes of the engine's latest forward over it (the resume's
re-prefill for a carried prompt and prefix, docs/protocol.md), so the trainer's old log-probs equal the engine's
to float32 rounding on every token sampled by the weights the trainer holds, over weight updates that carry,
cut, restart and resume responses. Tokens of older versions measure the policy's drift (`train/drift_*`), not a
mismatch. The same check at the public Qwen3-30B-A3B and Qwen3-0.6B per-layer shapes is the `slow` test below;
through the Ray path, `tests/test_ray_cluster.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_checks import FLOOR, REWARD
from engine_fixtures import SMALL_RUN, reset_server, run

from rollverify.app.config import load_config
from rollverify.app.train import resolve_model, train

pytestmark = [pytest.mark.engine, pytest.mark.megatron]
pytest_plugins = ["engine_fixtures"]  # the session's tiny MoE server

RUN = [
    *SMALL_RUN,
    "model.task=null",
    f"task.reward={REWARD}",
    "rollout.n=4",
    "rollout.max_new_tokens=64",
    "rollout.max_live=16",  # 2x over B * n: the tail is carried over every step
    "algo.mode=rollverify",
    "eval.every=0",
    "log.export_final=false",
]


def _server(*overrides: str):
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    cpu_compat.activate()
    cfg = load_config(None, [*RUN, *overrides])
    return launch_server(resolve_model(cfg), engine_args=cfg.servers.engine_args.args())


@pytest.fixture
def tiny_moe(moe_server):
    """The session's tiny MoE server (the untrained tiny Qwen3-MoE, this module's model), cleaned for the run."""
    run(reset_server(moe_server))
    return moe_server


def run_rows(server, out: Path, *overrides: str, steps: int = 4) -> list[dict]:
    cfg = load_config(None, [*RUN, f"trainer.steps={steps}", f"servers.endpoints=[\"{server.endpoint}\"]",
                             *overrides])
    train(cfg, out, progress=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_replay_at_the_floor(rows: list[dict], restarted: bool = True, resumed: bool = True,
                              drifted: bool = False) -> None:
    """At every step the trainer's own-version tokens agree with the engine; across the run responses were
    carried (2x over-provisioning carries the tail at every pause) and, as asked, restarted from the prompt (a
    drift above d_s), resumed from a kept prefix (a drift below it) and trained with older tokens. A step may
    train carried tokens only, so its own-version (mismatch) figures are null and its token count 0."""
    # a step may train only carried tokens of older versions (a group that finished before the update)
    mismatch = [r["train/mismatch_abs_max"] for r in rows if r["train/mismatch_tokens"]]
    assert mismatch and max(mismatch) < FLOOR, mismatch
    assert sum(r["verify/restarted"] for r in rows) > 0 or not restarted
    if not resumed:
        return
    assert sum(r["verify/kept_tokens"] for r in rows) > 0
    drift = [r["train/drift_tokens"] for r in rows]
    assert sum(drift) > 0 or not drifted, drift  # carried tokens reached training: the split had work to do
    assert all(r["trained_ops_mean"] >= r["train/mismatch_ops_mean"] for r in rows
               if r["train/drift_tokens"] and r["train/mismatch_tokens"])


@pytest.mark.parametrize("verify_on", ["trainer", pytest.param("engine", marks=pytest.mark.slow)])
def test_moe_replay_keeps_the_trainer_on_the_engine_across_resumes(tiny_moe, tmp_path, verify_on):
    rows = run_rows(tiny_moe, tmp_path / verify_on, "model.moe=true", f"algo.verify_on={verify_on}")
    check_replay_at_the_floor(rows)


# public per-layer shapes, 2 layers (Qwen3-30B-A3B with 16 of its 128 experts; Qwen3-0.6B), random weights
A3B_LAYER = ("model.tiny_overrides={hidden_size: 2048, num_heads: 32, num_kv_heads: 4, head_dim: 128, "
             "moe_intermediate_size: 768, intermediate_size: 768, num_experts: 16, top_k: 8}")
A3B_SERVE = "servers.engine_args.mem_fraction_static=0.15"  # its 0.8 GB of weights leave no KV cache at 0.05
DENSE_06B_LAYER = ("model.tiny_overrides={hidden_size: 1024, num_heads: 16, num_kv_heads: 8, head_dim: 128, "
                   "intermediate_size: 3072}")


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "resumed"), [
    # lr 1e-4: every carried response is cut to its prompt and restarts (stale routes would give a
    # mismatch of 1.7e-2 .. 2.6e-2 here)
    (("model.moe=true", A3B_LAYER, A3B_SERVE), False),
    # lr 1e-6: carried prefixes survive and resume
    (("model.moe=false", DENSE_06B_LAYER, "trainer.lr=1e-6"), True),
], ids=["qwen3_30b_a3b_layer", "qwen3_0_6b_layer"])
def test_replay_at_the_floor_at_real_layer_shapes(tmp_path, shape, resumed):
    # a kept prefix reaches training once its group completes, a step or more after the pause that carried it:
    # 8 steps leave every group carried at step 1 (never cut at lr 1e-6) seven steps to complete
    with _server(*shape) as server:
        rows = run_rows(server, tmp_path / "run", *shape, steps=8 if resumed else 4)
    check_replay_at_the_floor(rows, restarted=not resumed, resumed=resumed, drifted=resumed)
