"""A sandboxed Python interpreter: one fresh process tree per call, bounded in time, memory, processes and output.

Each call (`Sandbox.run`) gets:
- its own temporary folder as cwd, HOME and TMPDIR, removed afterwards;
- a scrubbed environment (PATH, LANG, HOME, TMPDIR only; the interpreter runs with -I, so no PYTHONPATH or user
  site applies);
- resource limits set in the program's process before exec, soft and hard alike where the hard one is the kill:
  CPU time (SIGXCPU at the limit, SIGKILL a second later), address space (allocation beyond it fails with
  MemoryError), processes (RLIMIT_NPROC, enforced by the kernel only for a user other than root), file size
  (SIGXFSZ) and open files;
- an unprivileged user (`nobody` by default) when the caller is root, with no-new-privileges set;
- new network and PID namespaces when `unshare` can make them (root here): inside, only a loopback interface
  that is down, so every connection fails with ENETUNREACH; and when the supervisor (PID 1 there) exits, the
  kernel kills every process left in the namespace, even one that left the process group;
- a wall-clock time-out that kills the whole process group; after the call, a scan of /proc kills anything of the
  call's process group or PID namespace still alive, so no process outlives its call;
- stdout and stderr read as they come, each kept up to its byte cap and counted beyond it (never buffered whole).

`SandboxResult.isolation` says what the call got: network "namespace" or "none", pid "namespace" or "none",
user "nobody" (the dropped-to user's name) or "same".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from rollverify.environment.limits import SandboxLimits, SandboxUnavailable
from rollverify.environment.procscan import kill_leftovers

CHILD_SOURCE = (Path(__file__).with_name("_sandbox_child.py")).read_text()
SYSTEM_PYTHON = "/usr/bin/python3"
READ_CHUNK = 1 << 16
COLLECT_BYTES = 1 << 16
# Time the parent waits for the pipes to close after the process group was killed.
DRAIN_GRACE_S = 1.0

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "namespaces_available"]


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed call did. `exit_code` is None when a signal ended the program (`killed_by` names it)."""

    exit_code: int | None
    killed_by: str | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    timed_out: bool
    wall_seconds: float
    cpu_seconds: float | None
    peak_memory_bytes: int | None
    isolation: dict[str, str]
    process_group: int
    pid_namespace: str | None
    leftovers_killed: int = 0
    error: str | None = None
    files: dict[str, str | None] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None

    def reason(self) -> str:
        """One line on how the call ended, for environment text and logs."""
        if self.error is not None:
            return f"sandbox error: {self.error}"
        if self.timed_out:
            return f"timed out after {self.limits.wall_seconds:g} s wall time (process group killed)"
        if self.killed_by == "SIGXCPU" or (self.killed_by == "SIGKILL" and self._cpu_spent()):
            return f"killed: CPU time limit of {self.limits.cpu_seconds:g} s exceeded"
        if self.killed_by == "SIGXFSZ":
            return f"killed: file size limit of {self.limits.file_bytes} bytes exceeded"
        if self.killed_by is not None:
            return f"killed by {self.killed_by}"
        return f"exit code {self.exit_code}"

    def _cpu_spent(self) -> bool:
        return self.cpu_seconds is not None and self.cpu_seconds >= math.ceil(self.limits.cpu_seconds)


@cache
def namespaces_available(unshare: str | None = None) -> bool:
    """Whether `unshare` can make network and PID namespaces here (needs root or CAP_SYS_ADMIN); probed once."""
    exe = unshare or shutil.which("unshare")
    if exe is None:
        return False
    try:
        done = subprocess.run(
            [exe, "--net", "--pid", "--fork", "--kill-child", "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class Sandbox:
    """Runs Python source under one `SandboxLimits`; thread-safe (each call owns its process, folder and pipes)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits if limits is not None else SandboxLimits()
        self._user = self._resolve_user()
        self._python = self._resolve_python()
        self._unshare = shutil.which("unshare") if self.limits.network_namespace else None
        self._namespaces = self._unshare is not None and namespaces_available(self._unshare)
        if self._user is not None:
            _check_traversable(Path(self.limits.base_dir or tempfile.gettempdir()), self._user[0])
        missing = [k for k, v in self.isolation.items() if k in self.limits.require and v in ("none", "same")]
        if missing:
            raise SandboxUnavailable(
                f"the sandbox requires {', '.join(sorted(missing))} isolation and this machine does not give it "
                f"(got {self.isolation}); run as root with util-linux unshare, or drop it from "
                "SandboxLimits.require"
            )

    @property
    def isolation(self) -> dict[str, str]:
        ns = "namespace" if self._namespaces else "none"
        user = self._user[0] if self._user is not None else "same"
        return {"network": ns, "pid": ns, "user": user, "python": self._python}

    def _resolve_user(self) -> tuple[str, int, int] | None:
        if os.geteuid() != 0 or not self.limits.user:
            return None
        try:
            entry = pwd.getpwnam(self.limits.user)
        except KeyError:
            raise SandboxUnavailable(
                f"SandboxLimits.user={self.limits.user!r} is not a user on this machine; name an existing "
                "unprivileged user, or set user=None to run as the caller (then RLIMIT_NPROC is not enforced)"
            ) from None
        return entry.pw_name, entry.pw_uid, entry.pw_gid

    def _resolve_python(self) -> str:
        if self.limits.python is not None:
            return self.limits.python
        if self._user is None:
            return sys.executable
        if not os.access(SYSTEM_PYTHON, os.X_OK):
            raise SandboxUnavailable(
                f"the sandbox drops to user {self._user[0]!r} and needs an interpreter that user can run; "
                f"{SYSTEM_PYTHON} does not exist here (the caller's {sys.executable} may not be readable by it). "
                "Install python3 or set SandboxLimits.python"
            )
        return SYSTEM_PYTHON

    def run(
        self, code: str, *, files: dict[str, str] | None = None, collect: Sequence[str] = ()
    ) -> SandboxResult:
        """Run `code` as a program (`main.py` in the call's folder, beside `files`); never raises for what it does.
        The files named in `collect` are read back (up to COLLECT_BYTES each) into `SandboxResult.files` before the
        folder is removed."""
        work = Path(tempfile.mkdtemp(prefix="rv-sandbox-", dir=self.limits.base_dir))
        try:
            self._populate(work, code, files or {})
            result = self._run_in(work)
            if collect:
                result = dataclasses.replace(result, files={n: _read_back(work, n) for n in collect})
            return result
        finally:
            _remove_tree(work)

    def _populate(self, work: Path, code: str, files: dict[str, str]) -> None:
        for name, text in {**files, "main.py": code}.items():
            target = (work / name).resolve()
            if work.resolve() not in target.parents:
                raise ValueError(f"sandbox file name {name!r} leaves the call's folder; use a relative name")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        os.chmod(work, 0o700)
        if self._user is not None:
            _, uid, gid = self._user
            for path in [work, *work.rglob("*")]:
                os.chown(path, uid, gid, follow_symlinks=False)

    def _command(self, work: Path, status_fd: int) -> list[str]:
        lim = self.limits
        cpu = math.ceil(lim.cpu_seconds)
        rlimits = {
            "RLIMIT_CPU": [cpu, cpu + 1],
            "RLIMIT_AS": [lim.memory_bytes, lim.memory_bytes],
            "RLIMIT_FSIZE": [lim.file_bytes, lim.file_bytes],
            "RLIMIT_NOFILE": [lim.open_files, lim.open_files],
            "RLIMIT_CORE": [0, 0],
        }
        if self._user is not None:
            rlimits["RLIMIT_NPROC"] = [lim.processes, lim.processes]
        spec = {
            "status_fd": status_fd,
            "rlimits": rlimits,
            "uid": self._user[1] if self._user else None,
            "gid": self._user[2] if self._user else None,
            "no_new_privs": True,
            "pid_namespace": self._namespaces,
            "python": self._python,
            "program": str(work / "main.py"),
            "env": self._env(work),
        }
        cmd = [self._python, "-I", "-c", CHILD_SOURCE, json.dumps(spec)]
        if self._namespaces:
            cmd = [self._unshare, "--net", "--pid", "--fork", "--kill-child", "--", *cmd]
        return cmd

    @staticmethod
    def _env(work: Path) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}

    def _run_in(self, work: Path) -> SandboxResult:
        lim = self.limits
        status_r, status_w = os.pipe()
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                self._command(work, status_w),
                cwd=work,
                env=self._env(work),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
            )
        except OSError as exc:
            os.close(status_r)
            os.close(status_w)
            return self._failed(f"could not start the sandbox: {exc}", time.monotonic() - started)
        os.close(status_w)
        pgid = proc.pid
        streams = _Capture(proc, status_r, lim.stdout_bytes, lim.stderr_bytes)
        timed_out = not streams.pump(started + lim.wall_seconds)
        # The program ended or ran out of time: nothing of its group may outlive the call.
        _killpg(pgid)
        streams.pump(time.monotonic() + DRAIN_GRACE_S)
        streams.close()
        returncode = proc.wait()
        wall = time.monotonic() - started
        status = streams.status()
        pid_ns = status.get("pid_ns") if self._namespaces else None
        if pid_ns == os.readlink("/proc/self/ns/pid"):
            # The supervisor runs in the caller's namespace after all (or its report was forged): scan by group.
            pid_ns = None
        leftovers = kill_leftovers(pgid, pid_ns)
        exit_code, killed_by = _decode(status.get("status"), returncode, timed_out)
        maxrss = status.get("maxrss_kib")
        return SandboxResult(
            exit_code=exit_code,
            killed_by=killed_by,
            stdout=streams.text(0),
            stderr=streams.text(1),
            stdout_truncated=streams.seen[0] > lim.stdout_bytes,
            stderr_truncated=streams.seen[1] > lim.stderr_bytes,
            stdout_bytes=streams.seen[0],
            stderr_bytes=streams.seen[1],
            timed_out=timed_out,
            wall_seconds=wall,
            cpu_seconds=status.get("cpu_seconds"),
            peak_memory_bytes=maxrss * 1024 if maxrss is not None else None,
            isolation=self.isolation,
            process_group=pgid,
            pid_namespace=pid_ns,
            leftovers_killed=leftovers,
            limits=lim,
        )

    def _failed(self, error: str, wall: float) -> SandboxResult:
        return SandboxResult(
            exit_code=None, killed_by=None, stdout="", stderr="", stdout_truncated=False, stderr_truncated=False,
            stdout_bytes=0, stderr_bytes=0, timed_out=False, wall_seconds=wall, cpu_seconds=None,
            peak_memory_bytes=None, isolation=self.isolation, process_group=-1, pid_namespace=None,
            error=error, limits=self.limits,
        )  # fmt: skip


class _Capture:
    """Reads stdout, stderr and the supervisor's status pipe as they come, keeping at most `caps` bytes of each."""

    def __init__(self, proc: subprocess.Popen, status_fd: int, *caps: int) -> None:
        self.proc = proc
        self.caps = caps
        self.kept: tuple[bytearray, bytearray] = (bytearray(), bytearray())
        self.seen = [0, 0]
        self.status_buf = bytearray()
        self.sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        for key, f in ((0, proc.stdout), (1, proc.stderr)):
            os.set_blocking(f.fileno(), False)
            self.sel.register(f.fileno(), selectors.EVENT_READ, key)
        os.set_blocking(status_fd, False)
        self.sel.register(status_fd, selectors.EVENT_READ, 2)

    def pump(self, deadline: float) -> bool:
        """Read until every pipe is closed (True) or `deadline` passes (False)."""
        while self.sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in self.sel.select(timeout=min(left, 0.5)):
                self._read(key.fd, key.data)
        return True

    def _read(self, fd: int, which: int) -> None:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(fd)
            if which == 2:
                os.close(fd)
            return
        if which == 2:
            self.status_buf += chunk
            return
        self.seen[which] += len(chunk)
        room = self.caps[which] - len(self.kept[which])
        if room > 0:
            self.kept[which].extend(chunk[:room])

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fd)
            if key.data == 2:
                os.close(key.fd)
        self.sel.close()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()

    def text(self, which: int) -> str:
        return self.kept[which].decode("utf-8", errors="replace")

    def status(self) -> dict:
        merged: dict = {}
        for line in self.status_buf.decode(errors="replace").splitlines():
            try:
                merged.update(json.loads(line))
            except ValueError:
                continue
        return merged


def _decode(status: int | None, returncode: int, timed_out: bool) -> tuple[int | None, str | None]:
    """(exit code, signal name) of the program from the supervisor's wait status, else from the top process."""
    if status is not None:
        if os.WIFSIGNALED(status):
            return None, signal.Signals(os.WTERMSIG(status)).name
        return os.WEXITSTATUS(status), None
    if returncode < 0:
        return None, signal.Signals(-returncode).name
    if timed_out:
        return None, "SIGKILL"
    return returncode, None


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _check_traversable(base: Path, user: str) -> None:
    """The sandbox user reaches its folder under `base` only if every folder above it lets others pass."""
    for folder in [base.resolve(), *base.resolve().parents]:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            raise SandboxUnavailable(
                f"the sandbox user {user!r} cannot reach folders under {base}: {folder} is not searchable by "
                "others; set SandboxLimits.base_dir (or TMPDIR) to a folder like /tmp"
            )


def _read_back(work: Path, name: str) -> str | None:
    """A regular file the program left in its folder (no link followed out of it), or None."""
    path = work / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or work.resolve() not in path.resolve().parents:
            return None
        return os.read(fd, COLLECT_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    def make_writable(func, p, _exc) -> None:  # noqa: ANN001 - shutil's onerror signature
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable)
