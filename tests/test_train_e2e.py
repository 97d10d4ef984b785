"""`rollverify train` end to end: real SGLang server, real Megatron-Core trainer, the tiny task model.

One server is shared by the module (runs connect to it through `servers.endpoints`, and each run pushes its
trainer's initial weights first); every run checks the accounting invariant after every step (Loop.run_step).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from engine_fixtures import SMALL_RUN

from rollverify.app.config import load_config
from rollverify.app.start import resolve_model
from rollverify.app.train import train
from rollverify.buffer import RolloutBuffer
from rollverify.types import Group

pytestmark = [pytest.mark.engine, pytest.mark.megatron]

SMALL = [*SMALL_RUN, "eval.every=0"]


@pytest.fixture(scope="module")
def server():
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    cpu_compat.activate()
    path = resolve_model(load_config(None, SMALL))
    engine_args = load_config(None, SMALL).servers.engine_args
    with launch_server(path, engine_args=engine_args.args()) as sp:
        yield sp


def run(server, tmp_path, *overrides: str, steps: int = 2, name: str = "run"):
    cfg = load_config(None, [*SMALL, f"trainer.steps={steps}", f"servers.endpoints=[\"{server.endpoint}\"]",
                             *overrides])
    out = tmp_path / name
    summary = train(cfg, out, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, out


# staleness_filter and ops_filter differ from partial only in the strategy's decisions, which the pure-logic tests
# hold (tests/test_loop_logic.py); their end-to-end runs are in the slow tier
@pytest.mark.parametrize("mode", ["on_policy", "partial", pytest.param("staleness_filter", marks=pytest.mark.slow),
                                  pytest.param("ops_filter", marks=pytest.mark.slow), "rollverify"])
def test_every_mode_runs_steps_with_exact_accounting(server, tmp_path, mode):
    summary, rows, _ = run(server, tmp_path, f"algo.mode={mode}", "algo.staleness_s=0", "algo.ops_gamma=0.001")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["n_finished_groups"] == 2 for r in rows)
    assert [r["policy_version"] for r in rows] == [1, 2]
    ledger = summary["ledger"]
    assert ledger["trained"] == 2 * 2 * 2  # steps x B x n
    if mode == "on_policy":
        assert all(r["n_carried"] == 0 for r in rows)
        assert ledger["launched"] == ledger["trained"]
    if mode == "partial":
        assert ledger["cut_tokens"] == 0


def test_conditional_switch_fires_on_forced_low_acceptance(server, tmp_path):
    # d_s = 0: every carried segment fails the sequence stage, so acceptance is 0 whenever anything is carried
    _, rows, _ = run(server, tmp_path, "algo.mode=rollverify", "algo.d_s=0.0", "algo.switch_window=1",
                     "rollout.max_live=16", steps=3)
    switched = [r["step"] for r in rows if r["switched"]]
    assert switched, f"no switch in {[(r['step'], r['acceptance_rate']) for r in rows]}"
    first = switched[0]
    assert rows[first - 1]["acceptance_rate"] < 0.5
    assert all(r["mode"] == "on_policy" for r in rows if r["step"] > first)


def test_resume_continues_from_the_checkpoint(server, tmp_path):
    _, rows, out = run(server, tmp_path, "algo.mode=rollverify", "log.checkpoint_every=1", steps=2, name="a")
    saved = json.loads((out / "checkpoint" / "loop.json").read_text())
    assert saved["step"] == 2 and saved["version"] == 2
    cfg = load_config(None, [*SMALL, "trainer.steps=3", f"servers.endpoints=[\"{server.endpoint}\"]",
                             "algo.mode=rollverify", "log.checkpoint_every=1"])
    summary = train(cfg, out, resume=out, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["policy_version"] == 3
    ledger = summary["ledger"]
    assert ledger["launched"] >= saved["ledger"]["launched"]
    assert ledger["trained"] == saved["ledger"]["trained"] + 4


def _served_weights() -> list:
    """The served checkpoint's tensors, (HF name, tensor): a weight update with them changes only the version."""
    from rollverify.app.export import hf_weight_buckets

    return [kv for bucket in hf_weight_buckets(resolve_model(load_config(None, SMALL))) for kv in bucket]


def test_resumed_prefixes_reuse_the_kv_of_the_engine_side_log_probs(server):
    """A weight update empties SGLang's prefix cache, so a response resumed after it prefills prompt + kept prefix
    again. After the engine-side log-probs (compute_logprobs) their KV is cached: a response cut to any prefix
    prefills only its last input token, also when it was held while another response generated (the loop's
    path). The counts are SGLang's own (`cached_tokens`, summed in the server's stats)."""
    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    weights = _served_weights()
    sampling = WireSamplingParams(ignore_eos=True)

    buffer = RolloutBuffer()

    def finish(engine, ids) -> None:
        while not all(buffer.get(rid).finished for rid in ids):
            for c in engine.wait_finished(1.0):
                buffer.record(c.response_id, c.token_ids, c.logprobs, c.versions, None, finish_reason=c.finish_reason,
                              offset=c.offset)

    with SGLangRolloutEngine([server.endpoint], poll_wait_s=0.1) as engine:
        engine.reset()

        def cycle(version: int, how: str) -> tuple[int, int, int]:
            """Generate, pause, update the weights, cut each response to half and resume it: the input tokens
            launched by the resume and how many SGLang found cached, and the number of responses."""
            for g in range(3):
                buffer.add_group(Group.new(10 * version + g, list(range(3 + 7 * g, 28 + 7 * g)), 1, 12))
            responses = [buffer.get(f"{10 * version + g}-0") for g in range(3)]
            ids = [r.response_id for r in responses]
            engine.submit(responses, sampling)
            finish(engine, ids)
            engine.pause()
            if how == "held":  # carried responses are unfinished: cut the finished ones, which leaves them paused
                trim = {r.response_id: r.num_tokens - 2 for r in responses}
                buffer.apply_truncation(trim)
                engine.truncate(trim)
            engine.update_weights(iter([weights]), version)
            keep = {r.response_id: r.num_tokens // 2 for r in responses}
            before = engine.stats()[0]
            if how == "plain":
                buffer.apply_truncation(keep)
                engine.truncate(keep)
                engine.resume()
            elif how == "logprobs":
                engine.compute_logprobs(responses)
                buffer.apply_truncation(keep)
                engine.truncate(keep)
                engine.resume()
            else:  # held: the server runs another response meanwhile
                engine.resume(hold=ids)
                buffer.add_group(Group.new(10 * version + 9, list(range(90, 110)), 1, 12))
                engine.submit(buffer.groups[10 * version + 9].responses, sampling)
                engine.compute_logprobs(responses)
                buffer.apply_truncation(keep)
                engine.truncate(keep)
                engine.release(ids)
                ids = [*ids, f"{10 * version + 9}-0"]
            finish(engine, ids)
            after = engine.stats()[0]
            engine.drop(ids)
            launched = after["tokens_launched"] - before["tokens_launched"] - (20 if how == "held" else 0)
            assert launched == sum(25 + k for k in keep.values())  # prompt + kept prefix each
            return launched, after["tokens_prefix_cached"] - before["tokens_prefix_cached"], len(keep)

        assert cycle(1, "plain")[1] == 0  # the update flushed the cache: everything prefilled again
        launched, cached, n = cycle(2, "logprobs")
        assert cached == launched - n  # all but each response's last input token
        launched, cached, n = cycle(3, "held")
        assert cached == launched - n  # the other response's prompt shares nothing with them


def test_engine_log_probs_of_the_last_vocabulary_id(server):
    """SGLang reports the input token id vocab_size - 1 as 0 in its input log-probs; a response holding that id
    gets its log-probs all the same, and they are its own, not token 0's at the same position."""
    import numpy as np

    from sglang_ext.protocol import WireSamplingParams
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    with SGLangRolloutEngine([server.endpoint], poll_wait_s=0.1) as engine:
        engine.reset()
        engine.pause()  # the responses below wait: nothing generates
        engine.update_weights(iter([_served_weights()]), 1)  # the engine's version, whatever the server's was
        last = engine.health()[0]["vocab_size"] - 1
        responses = []
        for gid, token in ((1, last), (2, 0)):
            r = Group.new(gid, list(range(3, 20)), 1, 12).responses[0]
            r.append(np.array([token, 5, token, 7]), np.zeros(4, np.float32), 0)
            responses.append(r)
        engine.submit(responses, WireSamplingParams(ignore_eos=True))
        with_last, with_zero = engine.compute_logprobs(responses)
        engine.drop([r.response_id for r in responses])
        engine.resume()
    assert len(with_last) == len(with_zero) == 4 and np.isfinite(with_last).all() and (with_last < 0).all()
    assert with_last[0] != with_zero[0] and with_last[2] != with_zero[2]


def test_engine_side_verification_matches_the_trainer_with_exact_accounting(server, tmp_path, monkeypatch):
    """algo.verify_on: engine on the real server and trainer (float32): three steps with the exact ledger, every
    carried response's new log-probs from the engine and none from the trainer; then, on the buffer the last step
    left, engine and trainer log-probs under the same weights agree per token within 1e-4 and verification cuts it
    at the same places from either.

    Each group's two responses get rewards 0 and 1, so every step's advantages are non-zero, and lr 1e-3 moves
    the policy far enough that carried tokens drift. Equal rewards within every group (the task's reward often
    gives the tiny model that) mean zero advantages, no gradient and, with weight decay 0, unchanged weights:
    every carried token's OPS would sit at the engine/trainer floor. The run verifies with infinite thresholds
    (the engine's log-probs and the statistics, no cut), so the drifted tokens stay in the buffer for the
    comparison: at the defaults a drift this large can cut every carried response back to its prompt."""
    import math

    import numpy as np
    import torch

    from rollverify.app.train import Run
    from rollverify.strategies import RollVerify
    from rollverify.verify import token_ops

    cfg = load_config(None, [*SMALL, "trainer.steps=3", f"servers.endpoints=[\"{server.endpoint}\"]",
                             "algo.mode=rollverify", "algo.verify_on=engine", "algo.conditional_switch=false",
                             "algo.d_s=inf", "algo.d_t=inf", "trainer.lr=1e-3"])
    run_ = Run(cfg, tmp_path / "run")
    try:
        forwards = []
        compute = run_.trainer.compute_logprobs
        monkeypatch.setattr(run_.trainer, "compute_logprobs", lambda rs, t: forwards.append(len(rs)) or compute(rs, t))
        monkeypatch.setattr(run_.loop.rollout, "reward", lambda group, response: float(response.index % 2))
        rows = [run_.loop.run_step().metrics for _ in range(3)]  # Ledger.check runs inside
        assert [r["policy_version"] for r in rows] == [1, 2, 3]
        assert sum(r["n_carried"] for r in rows) > 0 and forwards == []
        assert all(r["n_logprobs_on_engine"] == r["n_carried"] for r in rows if r["n_carried"])

        assert sum(r["n_launched_while_verifying"] for r in rows if r["n_carried"]) > 0  # overlapped the prefill
        run_.loop.rollout_phase()  # one more phase, ending paused: the carried responses wait, under version 3
        carried = run_.loop.buffer.carried_over()
        assert sum(r.num_tokens for r in carried) > 0
        on_engine = run_.engine.compute_logprobs(carried)
        on_trainer = compute(carried, cfg.rollout.temperature)
        diff = max(float(np.abs(a - b).max(initial=0.0)) for a, b in zip(on_engine, on_trainer, strict=True))
        assert diff < 1e-4, diff

        # the carried tokens drifted above the engine/trainer floor: both modes cut the buffer at the same places
        # under the defaults and under a token threshold in the widest gap among the drifted tokens' OPS, a gap
        # wider than twice the largest engine/trainer difference of any token's OPS
        old_lp = torch.from_numpy(np.concatenate([r.logprobs for r in carried]))
        ops = token_ops(old_lp, torch.from_numpy(np.concatenate(on_trainer))).numpy()
        ops_engine = token_ops(old_lp, torch.from_numpy(np.concatenate(on_engine))).numpy()
        noise = float(np.abs(ops - ops_engine).max())
        drifted = np.sort(ops[ops > 1e-5])
        assert len(drifted) >= 4, f"{len(drifted)} of {len(ops)} carried tokens drifted; largest OPS {ops.max()}"
        mid = drifted[len(drifted) // 4: 3 * len(drifted) // 4 + 1]
        i = int(np.argmax(np.diff(mid)))
        assert mid[i + 1] - mid[i] > 2 * noise, (mid, noise)
        for strategy in (RollVerify(cfg.algo.d_s, cfg.algo.d_t), RollVerify(math.inf, float(mid[i] + mid[i + 1]) / 2)):
            a = strategy.apply(carried, on_engine, run_.loop.version)
            b = strategy.apply(carried, on_trainer, run_.loop.version)
            assert a.keep_lengths.tolist() == b.keep_lengths.tolist()
        assert (a.keep_lengths < a.lengths).any()  # the mid threshold cuts: the comparison is not vacuous
    finally:
        run_.close()


# --- faults: trainer ranks, the driver, a full disk (rollverify.app.recovery, tools/chaos.py) -------------------


def _driver_logs(tmp_path) -> str:
    """The tails of the chaos run's driver logs (for a failure's message)."""
    return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(tmp_path.glob("chaos.driver*.log")))


def _chaos_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import chaos

    return chaos


# a "driver": starts its resource tracker, spawns a child (which inherits the tracker's pipe, as a trainer rank
# does), prints its tracker's pid and the child's and waits
TRACKER_DRIVER = """
import multiprocessing as mp, sys, time
from multiprocessing import resource_tracker

def child():
    time.sleep(600)

if __name__ == "__main__":
    resource_tracker.ensure_running()
    p = mp.get_context("spawn").Process(target=child, daemon=False)
    p.start()
    print(resource_tracker._resource_tracker._pid, p.pid, flush=True)
    time.sleep(600)
"""


def _wait_exited(pid: int, timeout_s: float = 60.0) -> None:
    """Until `pid` has exited (gone, or a zombie: an orphan whose reaper has not collected it holds no files)."""
    try:
        proc = psutil.Process(pid)
        deadline = time.monotonic() + timeout_s
        while proc.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"process {pid} did not exit in {timeout_s:.0f} s"
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pass


def test_a_tracker_counts_while_a_process_holds_its_pipe_and_its_holder_is_named(tmp_path):
    """tools/chaos.py's account of what a killed driver leaves: a real resource tracker, kept alive by a spawned
    child that holds its pipe, is left behind with its holder named (also a holder outside the given tree); once
    the holder is gone, the tracker has read the end of its pipe and no longer counts."""
    chaos = _chaos_module()
    script = tmp_path / "driver.py"
    script.write_text(TRACKER_DRIVER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        tracker, child = (int(x) for x in driver.stdout.readline().split())
        assert chaos.is_tracker(tracker) and not chaos.is_tracker(child)
        assert set(chaos.pipe_holders(tracker)) == {driver.pid, child}
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        left, holders = chaos.left_behind([driver.pid, tracker, child])
        assert left == sorted([tracker, child]) and list(holders[tracker]) == [child]
        # the child outside the tree given: still named, as what keeps the tracker
        left, holders = chaos.left_behind([driver.pid, tracker])
        assert left == sorted([tracker, child]) and list(holders[tracker]) == [child]
        psutil.Process(child).kill()
        _wait_exited(child)
        left, holders = chaos.left_behind([driver.pid, tracker, child])
        assert left == [] and holders == {}  # the tracker has its pipe's end, exiting or gone
    finally:
        for pid in (driver.pid, child):
            if pid is not None and psutil.pid_exists(pid):
                psutil.Process(pid).kill()


@pytest.mark.slow
def test_a_rank_killed_in_every_phase_restarts_from_the_checkpoint_and_logs_each_step_once(server, tmp_path,
                                                                                             monkeypatch):
    """The fault hook kills a trainer rank in each phase in turn (the trainer's optimizer-step count pins where):
    each is noticed at once, the ranks restart from the last checkpoint, the books of the run balance."""
    faults = [
        {"rank": 1, "method": "_logprobs", "step": 0},  # step 1's old-log-prob pass; no checkpoint yet
        {"rank": 0, "method": "_loss_pass", "step": 2},  # step 3's forward/backward
        {"rank": 1, "method": "compute_logprobs", "step": 4},  # step 4's verification forward
        {"rank": 0, "method": "sync_weights", "step": 5},  # step 5's weight push
        {"rank": 1, "method": "save_checkpoint", "step": 6},  # the checkpoint of step 6
    ]
    spec = tmp_path / "faults.json"
    spec.write_text(json.dumps(faults))
    monkeypatch.setenv("ROLLVERIFY_RANK_FAULTS", str(spec))
    _, rows, out = run(server, tmp_path, "trainer.dp=2", "log.checkpoint_every=2", "rollout.max_live=12",
                       "recovery.max_restarts=5", "log.tensorboard=true", steps=8)
    fired = [json.loads(Path(f"{spec}.fired-{i}").read_text())["time"] for i in range(len(faults))]
    records = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    trainer = [f for f in records if f["kind"] == "trainer"]
    assert [(f["rank"], f["method"]) for f in trainer] == [
        (1, "train_step"), (0, "train_step"), (1, "compute_logprobs"), (0, "iter_hf_tensors"),  # the push's call
        (1, "save_checkpoint")]
    assert [f["restored_step"] for f in trainer] == [0, 2, 2, 4, 4]
    assert [f["steps_redone"] for f in trainer] == [0, 0, 1, 0, 2]
    detect = [f["detected_at"] - t for f, t in zip(trainer, fired, strict=True)]
    # noticed by the rank's exit, not by a time-out (trainer.call_timeout_s is 3600 s): a bound far below that
    # and far above what a loaded machine takes to notice a dead process
    assert all(0 <= d < 300 for d in detect), detect
    chaos = _chaos_module()
    report = chaos.audit(out, 8, "", {}, load=False)
    assert all(report["checks"].values()) and report["responses_lost"] == 0, report
    assert [r["step"] for r in rows] == list(range(1, 9))


@pytest.mark.slow
def test_a_short_chaos_run_kills_a_rank_and_the_driver_and_fills_the_checkpoint_disk(server, tmp_path):
    """tools/chaos.py on the module's server: a trainer rank and the driver SIGKILLed at seeded moments, the
    checkpoint folder (a tmpfs, as root) filled once; the run finishes with its books exact and no process left.
    (The 60-step run with server kills is the slow test below.)"""
    cmd = [sys.executable, "tools/chaos.py", "--out", str(tmp_path / "chaos"), "--steps", "8",
           "--checkpoint-every", "2", "--servers", "0", "--ranks", "1", "--drivers", "1", "--fill", "1",
           "--endpoint", server.endpoint, "--no-load-check", "--timeout-s", "600", "--seed", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=1200)
    found = tmp_path / "chaos.chaos.json"
    report = json.loads(found.read_text()) if found.is_file() else {}
    assert r.returncode == 0 and report.get("ok"), (r.stdout[-3000:], r.stderr[-3000:], _driver_logs(tmp_path))
    assert report["responses_lost"] == 0 and report["recovered"]["rank"] == 1 and report["recovered"]["driver"] == 1
    if report["fill_on_tmpfs"]:
        assert report["recovered"]["fill"] == 1
    assert report["rank_detect_s"] is not None  # noticed (at the next trainer call when it died in a rollout)


@pytest.mark.slow
@pytest.mark.chaos
def test_chaos_run_of_60_steps(tmp_path):
    """The documented chaos run (docs/results.md): 60 steps, its own server (killed too), ranks, the driver
    twice, the checkpoint disk once; the final checkpoint loads in a fresh trainer."""
    cmd = ["nice", "-n", "19", sys.executable, "tools/chaos.py", "--out", str(tmp_path / "chaos"), "--steps", "60",
           "--seed", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=3600)
    found = tmp_path / "chaos.chaos.json"
    report = json.loads(found.read_text()) if found.is_file() else {}
    assert r.returncode == 0 and report.get("ok"), (r.stdout[-3000:], r.stderr[-3000:], _driver_logs(tmp_path))
    assert report["responses_lost"] == 0
    assert report["recovered"]["server"] == report["injected"]["server"]
    assert report["recovered"]["rank"] >= report["injected"]["rank"]
