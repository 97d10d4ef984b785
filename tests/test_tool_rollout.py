"""Multi-turn tool use end to end: `rollverify train` on the tool task with a real SGLang server and
the real Megatron-Core trainer on the tiny models.

The dense model is warm-started on `toolchain` (it calls the tool in the Qwen3 format); the MoE model is left
untrained, so its calls are mostly malformed: their error text is environment text like any output, and what
the test is about there is the routes of environment positions. Every run checks the ledger of both token kinds
after every step (`Rollout.end_step`), under the alternating schedule and the asynchronous one.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import numpy as np
import pytest

from rollverify.app.config import load_config
from rollverify.app.start import resolve_model
from rollverify.app.train import train
from rollverify.buffer import RolloutBuffer
from rollverify.types import ENVIRONMENT, POLICY

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


def test_multi_turn_run_keeps_both_ledgers_through_pauses_during_calls_and_a_resume(dense, tmp_path, monkeypatch):
    """Calls of a fixed 1 s. In the last step's phase the calls of every group but the B it completes first are
    held until the phase ends: those in flight then (a pause during a tool call) deliver once afterwards, at the
    checkpoint's settling, which therefore holds trajectories mid-way (environment tokens, unfinished); a resumed
    run continues them."""
    from rollverify.loop import Loop
    from rollverify.tool_turns import ToolTurns

    steps, gate = 3, threading.Event()
    gate.set()
    keep: set[int] = set()  # the last phase's groups whose calls run as usual
    phase, start = Loop.rollout_phase, ToolTurns.start

    def last_phase_holds(self):
        if self.step == steps - 1:
            keep.update(self.rollout.first_groups())
            gate.clear()
        try:
            return phase(self)
        finally:
            gate.set()

    def gated_start(self, response):
        start(self, response)
        if not gate.is_set() and response.group_id not in keep:
            call = self.pending[response.response_id]
            call.future = _after(gate, call.future)

    monkeypatch.setattr(Loop, "rollout_phase", last_phase_holds)
    monkeypatch.setattr(ToolTurns, "start", gated_start)
    summary, rows, out = run(dense, tmp_path, "task.options.latency_median_s=1.0", "task.options.latency_sigma=0.0",
                             "log.checkpoint_every=1", steps=steps)
    monkeypatch.undo()
    ledger = summary["ledger"]
    assert ledger["env_tokens"] > 0 and ledger["trained_env_tokens"] > 0
    assert sum(r["train/tokens"] for r in rows) == ledger["trained_tokens"]  # the loss counted policy tokens only
    assert sum(r["tools/outputs"] for r in rows) > 0 and all(r["tools/timeouts"] == 0 for r in rows)
    assert rows[-1]["tools/waiting"] > 0, "no held group called a tool in the last phase"
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


def _after(gate: threading.Event, inner: Future) -> Future:
    """A future with `inner`'s result that resolves only once `gate` is set."""
    out: Future = Future()
    out.set_running_or_notify_cancel()

    def relay() -> None:
        gate.wait()
        out.set_result(inner.result())

    threading.Thread(target=relay, daemon=True).start()
    return out


def hold_calls(tools, gate: threading.Event, held: threading.Event) -> None:
    """Calls that start while `gate` is clear run, but their outputs reach the run only once it is set (`held` is
    set when one starts): what is in flight at a given moment is then the test's to fix, not the tool's latency."""
    submit = tools.runner.submit_turn

    def gated(*args, **kwargs) -> Future:
        inner = submit(*args, **kwargs)
        if gate.is_set():
            return inner
        held.set()
        return _after(gate, inner)

    tools.runner.submit_turn = gated


def test_the_asynchronous_schedule_runs_tool_turns_and_a_call_in_flight_at_a_publish_goes_on_after_it(
        dense, tmp_path):
    """algo.schedule: async on the tool task: the server generates and the tool runs while the trainer trains.
    From the moment the first step's training starts until its publish ends, tool outputs are held back, and the
    training waits until a call has started meanwhile: that call is in flight at the publish by construction. It
    delivers once, after the publish, where its call ended, and the trajectory goes on under the new version;
    every trained policy token passed both stages against its step's policy; both ledgers hold after every step."""
    from rollverify.app.train import Run
    from rollverify.verify import two_stage_verify

    cfg = load_config("tiny_tools", [*BASE, "trainer.steps=4", f'servers.endpoints=["{dense.endpoint}"]',
                                     "algo.schedule=async", "cluster.placement=disaggregated", "algo.mode=rollverify",
                                     "algo.conditional_switch=false", "trainer.lr=1e-6"])
    (tmp_path / "run").mkdir()
    r = Run(cfg, tmp_path / "run")
    try:
        gate, held = threading.Event(), threading.Event()
        gate.set()
        hold_calls(r.tools, gate, held)
        trained: list[tuple] = []
        first: dict = {}
        train_step, publish = r.trainer.train_step, r.loop._publish

        def training(responses, advantages, temperature, policy_version, old_logprobs=None):
            if not first:  # the first step's training waits for a call the held tool cannot answer yet
                gate.clear()
                first["held"] = held.wait(300)
            trained.extend((x.response_id, x.token_ids.copy(), x.versions.copy(), x.sources.copy(),
                            x.logprobs.copy(), np.asarray(lp)) for x, lp in zip(responses, old_logprobs, strict=True))
            return train_step(responses, advantages, temperature, policy_version, old_logprobs=old_logprobs)

        def published():
            out = publish()
            if "waiting" not in first:
                first["waiting"] = {rid: r.loop.buffer.get(rid).num_tokens for rid in r.tools.pending}
            gate.set()
            return out

        r.trainer.train_step, r.loop._publish = training, published
        rows = [r.loop.run_step().metrics for _ in range(4)]  # the ledgers are checked after every step
        r.loop.settle_tools()
        assert first["held"] and first["waiting"], "no call was in flight at the first publish"
        assert [m["schedule"] for m in rows] == ["async"] * 4 and [m["policy_version"] for m in rows] == [1, 2, 3, 4]
        assert sum(m["tools/outputs"] for m in rows) > 0 and r.loop.ledger.trained_env_tokens > 0
        final = {rid: (ver, src) for rid, _, ver, src, _, _ in trained}
        final.update({x.response_id: (x.versions, x.sources) for g in r.loop.buffer.groups.values()
                      for x in g.responses})
        went_on = 0
        for rid, end in first["waiting"].items():
            ver, src = final[rid]
            if len(src) <= end or (ver[:end][src[:end] == POLICY] > 0).any():
                continue  # cut back by a later verification since (its call's output with it) and regenerated
            assert src[end - 1] == POLICY and src[end] == ENVIRONMENT  # the output, where its call ended
            env = np.flatnonzero(src[end:] != ENVIRONMENT)
            after = ver[end + env[0]:][src[end + env[0]:] == POLICY] if len(env) else ver[:0]
            assert (after >= 1).all()  # and the trajectory continued under the version published meanwhile
            went_on += len(after) > 0
        assert went_on, "no held trajectory continued after its output"
        for _, _, ver, src, lp, old in trained:  # every trained policy token passed both stages
            p = src == POLICY
            keep = two_stage_verify(old[p], lp[p], ver[p], np.array([int(p.sum())]), cfg.algo.d_s,
                                    cfg.algo.d_t).keep_lengths
            assert int(keep[0]) == int(p.sum())
    finally:
        r.close()
