"""sglang_ext.launch: what stopping a server leaves behind (a plain child process stands in for the server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_ext.launch import ServerProcess


@pytest.mark.parametrize("log_in_workdir", [False, True])
def test_stop_removes_the_start_folder_but_not_a_log_written_into_it(tmp_path, log_in_workdir):
    workdir = tmp_path / "serve"
    workdir.mkdir()
    (workdir / "ready.json").write_text("{}")
    log = (workdir if log_in_workdir else tmp_path) / "server.log"
    log.write_text("served\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sp = ServerProcess(proc=proc, endpoint="", info={}, log_path=log, workdir=workdir)
    sp.stop()
    assert sp.proc.returncode is not None and log.read_text() == "served\n"
    if log_in_workdir:
        assert sorted(p.name for p in workdir.iterdir()) == ["server.log"]
    else:
        assert not workdir.exists()
