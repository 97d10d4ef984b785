"""Multi-turn tool use end to end: `rollverify train` on the tool task with a real SGLang server and
the real Megatron-Core trainer on the tiny models.

The dense model is warm-started on `toolchain` (it calls the tool in the Qwen3 format); the MoE model is left
untrained, so its calls are mostly malformed: their error text is environment text like any output, and what
the test is about there is the routes of environment positions. Every run checks the ledger of both token kinds
after every step (Loop.run_step).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollverify.app.config import load_config
from rollverify.app.start import resolve_model
from rollverify.app.train import train
from rollverify.buffer import RolloutBuffer
from rollverify.types import ENVIRONMENT

pytestmark = [pytest.mark.engine, pytest.mark.megatron, pytest.mark.slow]  # ~4 min at load 20: two servers

BASE = ["rollout.batch_groups=2", "rollout.n=4", "rollout.max_live=16", "eval.every=0", "log.plots=false",
        "log.tensorboard=false", "trainer.lr=1e-4"]
STOP_ID = 101  # `</tool_call>` in the tiny model's vocabulary
MOE = ["model.moe=true", "model.task=null", "rollout.max_new_tokens=160", "tools.max_env_tokens=32"]


def _launch(overrides):
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    cpu_compat.activate()
    cfg = load_config("tiny_tools", overrides)
    return launch_server(resolve_model(cfg), engine_args=cfg.servers.engine_args.args())


@pytest.fixture(scope="module")
def dense():
    with _launch(BASE) as sp:
        yield sp


@pytest.fixture(scope="module")
def moe():
    with _launch([*BASE, *MOE]) as sp:
        yield sp


def run(server, tmp_path, *overrides, steps=2, name="run", resume=None):
    cfg = load_config("tiny_tools", [*BASE, f"trainer.steps={steps}", f'servers.endpoints=["{server.endpoint}"]',
                                     *overrides])
    out = tmp_path / name
    summary = train(cfg, out, resume=resume, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, out


def test_multi_turn_run_keeps_both_ledgers_through_pauses_during_calls_and_a_resume(dense, tmp_path):
    """Calls of a fixed 1 s: the phase ends while some run (a pause during a tool call), they deliver once
    afterwards; a checkpoint every step holds trajectories mid-way (environment tokens, unfinished) and a resumed
    run continues them."""
    summary, rows, out = run(dense, tmp_path, "task.options.latency_median_s=1.0", "task.options.latency_sigma=0.0",
                             "log.checkpoint_every=1", steps=3)
    ledger = summary["ledger"]
    assert ledger["env_tokens"] > 0 and ledger["trained_env_tokens"] > 0
    assert sum(r["train/tokens"] for r in rows) == ledger["trained_tokens"]  # the loss counted policy tokens only
    assert sum(r["tools/outputs"] for r in rows) > 0 and all(r["tools/timeouts"] == 0 for r in rows)
    assert any(r["tools/waiting"] > 0 for r in rows), "no phase ended with a call in flight"
    assert max(r["tools/turns_max"] for r in rows) >= 2 and any(r["tools/env_token_share"] > 0.2 for r in rows)
    # a well-formed call takes the tool's 1 s (a malformed one runs nothing)
    assert all(r["tools/tool_s_max"] >= 1.0 for r in rows if r["tools/outputs"] > r["tools/malformed"])
    buffer = RolloutBuffer.load(out / "checkpoint" / "buffer.npz")
    mid = [r for g in buffer.groups.values() for r in g.responses if r.num_env_tokens and not r.finished]
    assert mid, "the checkpoint holds no trajectory between turns"
    for r in mid:  # settled before the checkpoint: no call waits without its output
        assert r.sources[-1] == ENVIRONMENT or r.token_ids[-1] != STOP_ID

    summary2, rows2, _ = run(dense, tmp_path, "task.options.latency_median_s=1.0", "task.options.latency_sigma=0.0",
                             "log.checkpoint_every=1", steps=4, name="run", resume=out)
    assert [r["step"] for r in rows2][-1] == 4
    assert summary2["ledger"]["env_tokens"] > ledger["env_tokens"]


def test_engine_side_verification_reads_policy_tokens_only(dense, tmp_path):
    summary, rows, _ = run(dense, tmp_path, "algo.verify_on=engine", "algo.d_s=0.001", steps=3)
    carried_env = [r for r in rows if r.get("verify/env_tokens", 0) > 0]
    assert carried_env, "no carried response held environment tokens"
    for r in carried_env:  # acceptance counts policy tokens: the environment tokens are beside them
        assert r["verify/kept_tokens"] <= r["verify/verified_tokens"]
        assert r["verify/env_kept_tokens"] <= r["verify/env_tokens"]
        assert r["n_logprobs_on_engine"] > 0
    assert summary["ledger"]["cut_tokens"] > 0  # d_s 0.001 cuts: and the ledger still balances


def test_moe_routes_of_environment_positions_replay_at_the_float32_floor(moe, tmp_path):
    """On-policy, every trained token is the trainer's own version: with the engine's routes of every position
    replayed (environment positions' from its prefill of them), the recomputed log-probs equal the engine's."""
    summary, rows, _ = run(moe, tmp_path, *MOE, "algo.mode=on_policy", steps=2)
    assert summary["ledger"]["trained_env_tokens"] > 0
    for r in rows:
        assert r["train/mismatch_tokens"] > 0 and r["train/mismatch_abs_max"] < 1e-3, r["train/mismatch_abs_max"]
    assert sum(r["tools/malformed"] for r in rows) > 0  # an untrained model's calls: error text, never a crash
    assert np.isfinite([r["train/loss"] for r in rows]).all()
