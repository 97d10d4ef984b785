"""Fault handling without a model: checkpoints written whole or not at all (a real full disk where this user may
mount a tmpfs), the metrics rewind, the rank-side hook and parent watchdog, the supervisor's stop message."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bridge.proxy import RankFailure
from rollverify.app import rundir
from rollverify.app.checkpoints import CheckpointError, CheckpointStore
from rollverify.app.recovery import RecoveryConfig, RunStopped, Supervisor
from rollverify.metrics import MetricsWriter, load_metrics

ROOT = Path(__file__).resolve().parents[1]


def _writer(payload: bytes = b"x" * 1000):
    def write(d: Path) -> None:
        (d / "trainer").mkdir()
        (d / "trainer" / "shard").write_bytes(payload)
        (d / "buffer.npz").write_bytes(b"b")

    return write


def test_a_checkpoint_becomes_current_only_when_complete(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.current() is None
    store.save(2, _writer(), {"step": 2})
    assert store.current_step() == 2 and os.path.islink(tmp_path / "checkpoint")
    assert json.loads((tmp_path / "checkpoint" / "loop.json").read_text()) == {"step": 2}

    def broken(d: Path) -> None:
        _writer()(d)
        raise OSError(28, "No space left on device", str(d / "trainer" / "shard"))

    with pytest.raises(CheckpointError, match="step 4 could not be written.*No space left.*step 2 is kept"):
        store.save(4, broken, {"step": 4})
    assert store.current_step() == 2 and (tmp_path / "checkpoint" / "trainer" / "shard").read_bytes() == b"x" * 1000
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]  # nothing half-written
    store.save(6, _writer(b"y"), {"step": 6})
    assert store.current_step() == 6
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000006"]  # the older one removed


def test_a_rank_that_fails_to_write_keeps_the_previous_checkpoint_and_a_dead_one_propagates(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, _writer(), {"step": 1})

    def rank_error(d: Path) -> None:
        (d / "trainer").mkdir()
        raise RankFailure(1, "save_checkpoint", "error", "rank 1:\nTraceback ...\nOSError: [Errno 28] No space left")

    with pytest.raises(CheckpointError, match=r"OSError: \[Errno 28\] No space left.*step 1 is kept"):
        store.save(2, rank_error, {"step": 2})

    def rank_died(d: Path) -> None:
        (d / "trainer").mkdir()
        raise RankFailure(0, "save_checkpoint", "died", "exit code -9")

    with pytest.raises(RankFailure, match="died in save_checkpoint"):
        store.save(2, rank_died, {"step": 2})
    assert store.current_step() == 1 and not (tmp_path / "checkpoints" / "step_000002").exists()


def test_what_a_killed_save_left_is_cleaned(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(3, _writer(), {"step": 3})
    partial = tmp_path / "checkpoints" / "step_000005"
    partial.mkdir(parents=True)
    (partial / "buffer.npz").write_bytes(b"half")  # no loop.json: a save the driver died in
    foreign = tmp_path / "checkpoints" / "notes.txt"
    foreign.write_text("not the store's")
    store.clean()
    assert not partial.exists() and foreign.exists() and store.current_step() == 3
    store.save(6, _writer(), {"step": 6})
    assert store.current_step() == 6 and os.path.islink(tmp_path / "checkpoint") and foreign.exists()


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint_loadable(tmp_path):
    """A real ENOSPC: the checkpoints live on a 1 MiB tmpfs, the second save does not fit."""
    with _tmpfs(tmp_path / "checkpoints", "1m"):
        store = CheckpointStore(tmp_path)
        store.save(1, _writer(b"a" * 300_000), {"step": 1})
        with pytest.raises(CheckpointError, match="No space left on device") as info:
            store.save(2, _writer(b"b" * 900_000), {"step": 2})
        assert info.value.kept == 1
        assert store.current_step() == 1 and (tmp_path / "checkpoint" / "trainer" / "shard").read_bytes() == b"a" * 300_000
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
        store.save(3, _writer(b"c" * 300_000), {"step": 3})  # space again once the failed one is gone
        assert store.current_step() == 3


def test_an_empty_checkpoints_folder_made_before_the_run_is_no_run(tmp_path):
    (tmp_path / "checkpoints").mkdir()  # e.g. the mount point of a checkpoint volume
    assert rundir.claim(tmp_path) == tmp_path
    (tmp_path / "checkpoints" / "step_000001").mkdir()
    with pytest.raises(rundir.RunFolderError):
        rundir.claim(tmp_path)
    with _tmpfs(tmp_path / "checkpoints", "1m"):  # --overwrite empties the mount point, leaves it mounted
        (tmp_path / "checkpoints" / "step_000002").mkdir()
        (tmp_path / "metrics.jsonl").write_text("{}\n")
        assert rundir.claim(tmp_path, overwrite=True) == tmp_path
        assert (tmp_path / "checkpoints").is_dir() and not any((tmp_path / "checkpoints").iterdir())


def test_rewind_forgets_the_steps_after_the_checkpoint(tmp_path):
    w = MetricsWriter(tmp_path, SimpleNamespace(tensorboard=True, plots=False))
    for s in range(1, 6):
        w.write({"step": s, "reward_mean": float(s)})
    w.rewind(3)
    w.write({"step": 4, "reward_mean": 40.0})
    w.close()
    rows = load_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["reward_mean"] == 40.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


HOOK_CHILD = textwrap.dedent("""
    import sys
    from megatron_bridge.rank_faults import arm
    class T:
        def train_step(self):
            return "ok"
    t = T()
    print(len(arm(t, int(sys.argv[1]))), flush=True)
    for _ in range(3):
        print(t.train_step(), flush=True)
""")


@pytest.mark.system
def test_the_fault_hook_kills_the_rank_once_at_the_named_call(tmp_path):
    spec = tmp_path / "faults.json"
    spec.write_text(json.dumps([{"rank": 1, "method": "train_step", "call": 2}]))
    env = {**os.environ, "ROLLVERIFY_RANK_FAULTS": str(spec), "PYTHONPATH": str(ROOT)}

    def child(rank: int):
        return subprocess.run([sys.executable, "-c", HOOK_CHILD, str(rank)], capture_output=True, text=True, env=env,
                              timeout=60)

    other = child(0)
    assert other.returncode == 0 and other.stdout.split() == ["0", "ok", "ok", "ok"]
    first = child(1)
    assert first.returncode == -signal.SIGKILL and first.stdout.split() == ["1", "ok"]  # died at its 2nd call
    assert json.loads(Path(f"{spec}.fired-0").read_text())["time"] <= time.time()
    again = child(1)  # the restarted rank: the fault fired already
    assert again.returncode == 0 and again.stdout.split() == ["0", "ok", "ok", "ok"]
    assert child(1).returncode == 0
    del env["ROLLVERIFY_RANK_FAULTS"]


WATCH_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    code = "from megatron_bridge.rank_faults import watch_parent; import time; watch_parent(0.1); time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code])
    print(p.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.system
def test_a_rank_process_exits_when_its_driver_is_killed(tmp_path):
    import psutil

    driver = subprocess.Popen([sys.executable, "-c", WATCH_PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        rank = psutil.Process(int(driver.stdout.readline()))
        time.sleep(0.5)  # its watchdog has started (the import and the thread)
        assert rank.is_running()
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        rank.wait(timeout=10)  # raises psutil.TimeoutExpired if it outlives its driver
    finally:
        driver.kill()
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()


class _FakeRun:
    """What the supervisor touches of a Run: a loop at some step, a trainer restart that fails as told."""

    def __init__(self, out: Path, max_restarts: int) -> None:
        self.out = out
        self.cfg = SimpleNamespace(recovery=RecoveryConfig(max_restarts=max_restarts))
        self.loop = SimpleNamespace(step=7)
        self.engine = SimpleNamespace(faults=[])
        self.restarts, self.closed = 0, 0
        self.checkpoints = CheckpointStore(out)
        self.checkpoints.save(5, _writer(), {"step": 5})

    def restart_trainer(self) -> int:
        self.restarts += 1
        self.loop.step = 5
        return 5

    def close_trainer(self) -> None:
        self.closed += 1


def test_past_max_restarts_the_run_stops_naming_rank_phase_and_the_resume_command(tmp_path):
    run = _FakeRun(tmp_path, max_restarts=1)
    writer = SimpleNamespace(rewound=[], rewind=lambda step: writer.rewound.append(step))
    sup = Supervisor(run, writer, "rollverify train --config R/config.json --resume R")
    sup._restart(RankFailure(1, "train_step", "died", "exit code -9"))
    assert run.restarts == 1 and writer.rewound == [5]
    run.loop.step = 8
    with pytest.raises(RunStopped) as info:
        sup._restart(RankFailure(0, "compute_logprobs", "silent", "no reply within 120 s"))
    text = str(info.value)
    assert "trainer rank 0 stopped answering in the verification forward (compute_logprobs) after step 8" in text
    assert "recovery.max_restarts: 1" in text and text.endswith("rollverify train --config R/config.json --resume R")
    assert run.closed == 1
    faults = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["rank"], f["phase"], f["action"]) for f in faults] == [
        (1, "train step (old log-probs, forward/backward, optimizer)", "restart"),
        (0, "verification forward", "stop")]
    assert faults[0]["steps_redone"] == 2 and faults[0]["restored_step"] == 5


def test_a_rank_that_dies_while_the_new_ranks_start_counts_as_the_next_fault(tmp_path):
    run = _FakeRun(tmp_path, max_restarts=3)
    calls = []

    def restart() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RankFailure(1, "start", "died", "exit code -9")
        return 0

    run.restart_trainer = restart
    sup = Supervisor(run, SimpleNamespace(rewind=lambda step: None), "cmd")
    sup._restart(RankFailure(0, "train_step", "died"))
    assert sup.restarts == 2 and len(calls) == 2
    faults = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert faults[0]["restart_failed"].startswith("trainer rank 1 died in start") and faults[1]["phase"] == "start-up"


SERVER_GUARD = textwrap.dedent("""
    import subprocess, sys, time
    code = ("import subprocess, sys, time; from sglang_ext.server import guard_parent; "
            "guard_parent(int(sys.argv[1]), grace_s=5.0); "
            "print(subprocess.Popen(['sleep', '120']).pid, flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, str(__import__("os").getpid())])
    print(p.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.system
def test_a_server_still_starting_exits_when_its_launcher_dies(tmp_path):
    """`rollverify serve --exit-with-parent --parent-pid P` watches P from its first moments (a thread, while
    SGLang starts and blocks the event loop): the launcher's death ends it and every process under it (SGLang's
    children may not have set their own parent-death signal yet)."""
    import psutil

    launcher = subprocess.Popen([sys.executable, "-c", SERVER_GUARD], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    procs = []
    try:
        procs = [psutil.Process(int(launcher.stdout.readline())) for _ in range(2)]  # the server, its child
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, alive
    finally:
        launcher.kill()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
