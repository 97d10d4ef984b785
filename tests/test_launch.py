"""sglang_ext.launch: what stopping a server leaves behind (a plain child process stands in for the server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_ext.launch import ServerProcess

pytestmark = pytest.mark.system  # plain child processes stand in for servers


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


def test_a_server_past_its_startup_limit_is_stopped_with_its_last_log_lines(tmp_path, monkeypatch):
    """`servers.startup_s` bounds `rollverify train`'s server start (`start_engine`): a server not serving
    by then is stopped and the error carries its log's last lines. A plain child process that logs and never
    becomes ready stands in for the server."""
    import psutil

    import sglang_ext.launch as launch
    from rollverify.app.config import load_config
    from rollverify.app.start import start_engine
    from sglang_ext.launch import ServerStartError

    pid_file = tmp_path / "pid"
    script = (f"import os, sys, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "print('loading weights', flush=True); print('capturing cuda graphs', flush=True); time.sleep(120)")
    monkeypatch.setattr(launch, "server_command", lambda *a, **k: [sys.executable, "-c", script])
    cfg = load_config("tiny_cpu", ["servers.startup_s=3"])
    assert load_config("qwen3_8b_base", check_task=False).servers.startup_s == 1800  # a cold 8B start
    with pytest.raises(ServerStartError, match=r"not ready after 3 s:\nloading weights\ncapturing cuda graphs"):
        start_engine(cfg, tmp_path, tmp_path)
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
