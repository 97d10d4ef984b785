"""Start `rollverify serve` as a child process and stop it without leaving any of its processes behind.

Used by the loop, the tests and the benchmark. The server writes a ready file (endpoint, pid, model facts)
once it serves; the launcher waits for it, or reports the server's own error if it exits first. Stopping asks
for a graceful shutdown, then ends the server and every descendant it had, by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ServerStartError(RuntimeError):
    """The server exited (or timed out) before serving; the message carries its last log lines."""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    endpoint: str
    info: dict[str, Any]
    log_path: Path
    workdir: Path | None = None  # the start's own folder (ready file; the log unless log_path is elsewhere)
    _known: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """The server process has not exited (the rollout engine's watchdog asks every handle this, local
        processes and sglang_ext.ray_server's actors alike)."""
        return self.proc.poll() is None

    def __str__(self) -> str:
        code = self.proc.poll()
        return f"pid {self.pid}" + ("" if code is None else f", exit code {code}")

    def descendants(self) -> list[int]:
        import psutil

        try:
            pids = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pids = []
        self._known.update(pids)
        return pids

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the server shuts SGLang down gracefully), then SIGKILL what is left, by pid."""
        import psutil

        self.descendants()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        leftovers = []
        for pid in self._known:
            try:
                p = psutil.Process(pid)
                p.kill()
                leftovers.append(p)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=10)
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        """The start's folder goes with the server; a log written there (no log_path given) stays, with it."""
        if self.workdir is None:
            return
        (self.workdir / "ready.json").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.workdir.rmdir()  # only when empty: the log of a start without log_path is kept

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_command(
    model: str | os.PathLike,
    ready_file: Path,
    *,
    control: str = "tcp://127.0.0.1:0",
    args: list[str] | None = None,
    engine_args: dict[str, Any] | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "sglang_ext.server",
        "--model",
        str(model),
        "--control",
        control,
        "--ready-file",
        str(ready_file),
        "--exit-with-parent",
        "--parent-pid",
        str(os.getpid()),
    ]
    for k, v in (engine_args or {}).items():
        cmd += ["--engine-arg", f"{k}={json.dumps(v)}"]
    return cmd + list(args or [])


def launch_server(
    model: str | os.PathLike,
    *,
    control: str = "tcp://127.0.0.1:0",
    args: list[str] | None = None,
    engine_args: dict[str, Any] | None = None,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 300.0,
) -> ServerProcess:
    """Run a control server for `model` and return once it serves (ready file written)."""
    workdir = Path(tempfile.mkdtemp(prefix="rollverify-serve-"))
    ready = workdir / "ready.json"
    log_file = Path(log_path) if log_path else workdir / "server.log"
    cmd = server_command(model, ready, control=control, args=args, engine_args=engine_args)
    with open(log_file, "ab") as logf:
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    sp = ServerProcess(proc=proc, endpoint="", info={}, log_path=log_file, workdir=workdir)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not ready.exists():
            sp.descendants()
            if proc.poll() is not None:
                raise ServerStartError(
                    f"rollverify serve exited with code {proc.returncode}:\n{sp.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"rollverify serve not ready after {startup_timeout_s:.0f} s:\n{sp.log_tail()}"
                )
            time.sleep(0.1)
        sp.info = json.loads(ready.read_text())
        sp.endpoint = sp.info["endpoint"]
        sp.descendants()
        return sp
    except BaseException:
        sp.stop()
        raise
