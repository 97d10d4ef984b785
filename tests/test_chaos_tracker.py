"""tools/chaos.py's account of what a killed driver leaves: a real multiprocessing resource tracker, kept alive
by a spawned child that holds its pipe, is left behind with its holder named (also a holder outside the
driver's tree); once the holder is gone, the tracker has read the end of its pipe and no longer counts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

# a "driver": starts its resource tracker, spawns a child (which inherits the tracker's pipe, as a trainer rank
# does), prints the three pids and waits
DRIVER = """
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


def _chaos():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import chaos
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return chaos


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
    chaos = _chaos()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
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
