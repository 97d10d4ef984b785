"""The caller's end of the sandbox's zygote: one small process per caller process and interpreter that forks each
call's supervisor (see `_sandbox_child.py`), so a call starts no interpreter and imports nothing for it.

The zygote runs as the caller's user, in a session of its own, and exits when the caller's end of its socket
closes (the caller exited). A call's descriptors travel to it over the socket (SCM_RIGHTS); it answers with the
supervisor's pid, which is also the call's process group. A zygote that died is started again on the next call.
"""

from __future__ import annotations

import marshal
import os
import socket
import subprocess
import threading
from pathlib import Path

CHILD_SOURCE = (Path(__file__).with_name("_sandbox_child.py")).read_text()


class Launcher:
    """Forks call supervisors through one zygote; thread-safe."""

    _by_key: dict[tuple[int, str], Launcher] = {}
    _guard = threading.Lock()

    @classmethod
    def get(cls, python: str) -> Launcher:
        """This process's launcher for `python` (a forked caller gets its own)."""
        key = (os.getpid(), python)
        with cls._guard:
            if key not in cls._by_key:
                cls._by_key[key] = cls(python)
            return cls._by_key[key]

    def __init__(self, python: str) -> None:
        self.python = python
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [self.python, "-I", "-S", "-c", CHILD_SOURCE, str(theirs.fileno())],
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours

    def spawn(self, spec: dict, fds: list[int]) -> int:
        """Start one call's supervisor with `spec` and `fds` (stdout, stderr, status, [channel in, channel out]);
        its pid. OSError when no zygote can be reached (after one restart)."""
        body = marshal.dumps(spec)
        with self.lock:
            for attempt in (0, 1):
                if self.sock is None:
                    self._start()
                assert self.sock is not None
                try:
                    socket.send_fds(self.sock, [len(body).to_bytes(8, "big")], fds)
                    self.sock.sendall(body)
                    answer = self._recv(8)
                    if answer is not None:
                        return int.from_bytes(answer, "big")
                    raise ConnectionError("the sandbox's zygote closed its socket")
                except OSError:
                    self._drop()
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    def _recv(self, n: int) -> bytes | None:
        assert self.sock is not None
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.proc = None
