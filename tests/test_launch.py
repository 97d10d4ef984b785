"""sglang_ext.launch: what stopping a server leaves behind (a plain child process stands in for the server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sglang_ext.launch import ServerProcess


def _started(workdir: Path, log_path: Path) -> ServerProcess:
    (workdir / "ready.json").write_text("{}")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return ServerProcess(proc=proc, endpoint="", info={}, log_path=log_path, workdir=workdir)


def test_stop_removes_the_start_folder_when_the_log_lives_elsewhere(tmp_path):
    workdir = tmp_path / "serve"
    workdir.mkdir()
    log = tmp_path / "server.log"
    log.write_text("served\n")
    sp = _started(workdir, log)
    sp.stop()
    assert sp.proc.returncode is not None
    assert not workdir.exists() and log.read_text() == "served\n"


def test_stop_keeps_a_log_written_into_the_start_folder(tmp_path):
    workdir = tmp_path / "serve"
    workdir.mkdir()
    log = workdir / "server.log"
    log.write_text("served\n")
    sp = _started(workdir, log)
    sp.stop()
    assert sorted(p.name for p in workdir.iterdir()) == ["server.log"]
