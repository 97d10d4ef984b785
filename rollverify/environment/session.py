"""One running sandboxed call, seen from the caller: its supervisor process, pipes, cgroup and message channel.

The call's supervisor is forked by the zygote (`launcher`), not by the caller, so the call is seen through its
pipes and its process group rather than a child process. The caller reads stdout, stderr, the supervisor's status lines and the program's channel as they come (each
stream kept up to its cap and counted beyond it, never buffered whole), writes to the program's channel without
ever blocking on it, and at the end kills whatever of the call is left (cgroup, process group, PID namespace)
before it returns the `SandboxResult`. Everything that comes from the program is data: the channel's frames are
size-capped and parsed as JSON objects, never evaluated.
"""

from __future__ import annotations

import ast
import os
import selectors
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollverify.environment.cgroups import CallCgroup
from rollverify.environment.limits import SandboxLimits
from rollverify.environment.procscan import kill_leftovers
from rollverify.environment.result import SandboxResult, decode_status
from rollverify.environment.wire import FrameReader, WireError, frame

if TYPE_CHECKING:
    from rollverify.environment.sandbox import Launched

READ_CHUNK = 1 << 16
# Time the caller waits for the pipes to close after the call's processes were killed.
DRAIN_GRACE_S = 1.0
STDOUT, STDERR, STATUS, CHANNEL = range(4)


class ChannelError(RuntimeError):
    """The program broke the message channel (a frame over the cap, not JSON, or written after a refusal)."""


class SandboxSession:
    """A started call; `send`/`recv` talk to the program (descriptors 3 and 4 inside), `finish` ends the call."""

    def __init__(
        self,
        launched: Launched,
        limits: SandboxLimits,
        isolation: dict[str, str],
        cgroup: CallCgroup | None,
        work: Path | None,
        started: float,
        max_frame: int,
    ) -> None:
        self.pid = launched.pid
        self.limits = limits
        self.isolation = isolation
        self.cgroup = cgroup
        self.work = work
        self.started = started
        self.deadline = started + limits.wall_seconds
        self.kept: tuple[bytearray, bytearray] = (bytearray(), bytearray())
        self.seen = [0, 0]
        self.status_buf = bytearray()
        self.frames = FrameReader(max_frame)
        self.inbox: list[dict[str, Any]] = []
        self.channel_error: str | None = None
        self.sel = selectors.DefaultSelector()
        self._fds: dict[int, int] = {}
        for which, fd in ((STDOUT, launched.stdout), (STDERR, launched.stderr), (STATUS, launched.status)):
            self._watch(fd, which)
        self.chan_in: int | None = None
        if launched.chan is not None:
            self.chan_in = launched.chan[0]
            os.set_blocking(self.chan_in, False)
            self._watch(launched.chan[1], CHANNEL)
        self._result: SandboxResult | None = None

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish(kill=True)

    def _watch(self, fd: int, which: int) -> None:
        os.set_blocking(fd, False)
        self._fds[fd] = which
        self.sel.register(fd, selectors.EVENT_READ, which)

    # --- reading ---------------------------------------------------------------------------------------------

    def _pump_once(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout=max(0.0, timeout)):
            self._read(key.fd, key.data)

    def _read(self, fd: int, which: int) -> None:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._unwatch(fd)
            return
        if which == STATUS:
            self.status_buf += chunk
        elif which == CHANNEL:
            self._frames_in(chunk)
        else:
            self.seen[which] += len(chunk)
            cap = (self.limits.stdout_bytes, self.limits.stderr_bytes)[which]
            room = cap - len(self.kept[which])
            if room > 0:
                self.kept[which].extend(chunk[:room])

    def _frames_in(self, chunk: bytes) -> None:
        if self.channel_error is not None:
            return
        try:
            self.frames.feed(chunk)
            while (message := self.frames.next()) is not None:
                self.inbox.append(message)
        except WireError as exc:
            self.channel_error = str(exc)
            self.frames.buf.clear()

    def _unwatch(self, fd: int) -> None:
        if fd in self._fds:
            self.sel.unregister(fd)
            del self._fds[fd]
            os.close(fd)

    def pump(self, until: float) -> bool:
        """Read until every pipe is closed (True) or `until` passes (False)."""
        while self._fds:
            left = until - time.monotonic()
            if left <= 0:
                return False
            self._pump_once(min(left, 0.5))
        return True

    @property
    def channel_open(self) -> bool:
        return CHANNEL in self._fds.values() or bool(self.inbox)

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        """The program's next message, or None when none came in `timeout_s` (or by the call's deadline) or the
        channel closed. ChannelError when the program wrote something that is not a well-formed message."""
        until = min(time.monotonic() + timeout_s, self.deadline)
        while True:
            if self.channel_error is not None:
                raise ChannelError(self.channel_error)
            if self.inbox:
                return self.inbox.pop(0)
            if CHANNEL not in self._fds.values():
                return None
            left = until - time.monotonic()
            if left <= 0:
                return None
            self._pump_once(min(left, 0.5))

    # --- writing ---------------------------------------------------------------------------------------------

    def send(self, message: dict[str, Any], timeout_s: float | None = None) -> bool:
        """Write one message to the program; False when it is not read in time or the program is gone."""
        if self.chan_in is None:
            return False
        data = memoryview(frame(message))
        until = self.deadline if timeout_s is None else min(self.deadline, time.monotonic() + timeout_s)
        while data:
            try:
                n = os.write(self.chan_in, data)
                data = data[n:]
                continue
            except BlockingIOError:
                pass
            except OSError:  # the program closed its end (or died)
                self.close_input()
                return False
            left = until - time.monotonic()
            if left <= 0:
                return False
            self.sel.register(self.chan_in, selectors.EVENT_WRITE, -1)
            try:
                for key, _ in self.sel.select(timeout=min(left, 0.5)):
                    if key.data != -1:
                        self._read(key.fd, key.data)
            finally:
                self.sel.unregister(self.chan_in)
        return True

    def close_input(self) -> None:
        """End of requests: the program reads EOF on descriptor 3."""
        if self.chan_in is not None:
            os.close(self.chan_in)
            self.chan_in = None

    # --- the end ---------------------------------------------------------------------------------------------

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            self.cgroup.kill()

    def finish(self, kill: bool = False) -> SandboxResult:
        """Wait for the program to end (until the wall deadline; at once with `kill`), kill whatever is left of the
        call, and return its result. Idempotent."""
        if self._result is not None:
            return self._result
        self.close_input()
        timed_out = False if kill else not self.pump(self.deadline)
        self.kill()
        self.pump(time.monotonic() + DRAIN_GRACE_S)
        for fd in list(self._fds):
            self._unwatch(fd)
        self.sel.close()
        self._result = self._collect(timed_out, killed_early=kill)
        return self._result

    def events(self) -> dict[str, Any]:
        """The supervisor's events by kind ("start", "limit", "exit", "error"), the first of each kind."""
        events: dict[str, Any] = {}
        for line in self.status_buf.decode(errors="replace").splitlines():
            try:
                record = ast.literal_eval(line)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(record, dict) and isinstance(record.get("event"), str):
                events.setdefault(record["event"], record)
        return events

    def _collect(self, timed_out: bool, killed_early: bool) -> SandboxResult:
        lim, events = self.limits, self.events()
        start, end = events.get("start", {}), events.get("exit", {})
        pid_ns = start.get("pid_ns") if self.isolation["pid"] == "namespace" else None
        if pid_ns == os.readlink("/proc/self/ns/pid"):
            pid_ns = None  # the supervisor runs in the caller's namespace after all: scan by group
        limit_hit = events.get("limit", {}).get("what")
        peak = end.get("peak_bytes")
        forks_refused = 0
        if self.cgroup is not None:
            leftovers = self.cgroup.kill()
            if self.cgroup.oom_kills():
                limit_hit = "memory"
            forks_refused = self.cgroup.forks_refused()
            peak = self.cgroup.peak_memory()
            self.cgroup.close()
        else:
            leftovers = 0
        # by process group and PID namespace too: a process of the call outside its cgroup (or one the kernel is
        # still tearing down) is gone before the result is returned
        leftovers += kill_leftovers(self.pid, pid_ns)
        if peak is None and end.get("maxrss_kib") is not None:
            peak = end["maxrss_kib"] * 1024
        exit_code, killed_by = decode_status(end.get("status"), timed_out or killed_early)
        if self.work is not None:
            _remove_tree(self.work)
        error = events["error"].get("message") if "error" in events else None
        return SandboxResult(
            exit_code=exit_code,
            killed_by=killed_by,
            stdout=self.kept[0].decode("utf-8", errors="replace"),
            stderr=self.kept[1].decode("utf-8", errors="replace"),
            stdout_truncated=self.seen[0] > lim.stdout_bytes,
            stderr_truncated=self.seen[1] > lim.stderr_bytes,
            stdout_bytes=self.seen[0],
            stderr_bytes=self.seen[1],
            timed_out=timed_out,
            wall_seconds=time.monotonic() - self.started,
            cpu_seconds=end.get("cpu_seconds"),
            peak_memory_bytes=peak,
            isolation=self.isolation,
            process_group=self.pid,
            pid_namespace=pid_ns,
            leftovers_killed=leftovers,
            limit_hit=limit_hit,
            forks_refused=forks_refused,
            error=error,
            limits=lim,
        )


def _remove_tree(path: Path) -> None:
    import shutil

    def make_writable(func, p, _exc) -> None:  # noqa: ANN001 - shutil's onerror signature
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable)
