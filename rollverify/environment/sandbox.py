"""A sandboxed Python interpreter: one fresh, isolated process tree per call, bounded as a whole.

Each call (`Sandbox.run`, or `Sandbox.start` for a call the caller talks to while it runs) gets, where the machine
allows it (root with util-linux-era kernel features; `isolation` says what each call got):
- a cgroup of its own (v2 where it offers memory and pids, else v1): memory (processes and tmpfs together),
  processes and threads, and a CPU quota hold for the whole call, and calls share the CPU by call, not by process;
- its own PID namespace (its init is the supervisor: when it exits the kernel kills everything left there),
  network namespace (only a loopback that is down: every connection fails), IPC and UTS namespaces;
- its own mount namespace and root: the host's `host_paths` read-only, /dev with null, zero, full, random,
  urandom, and its own /proc, /tmp (its working folder) and /dev/shm as tmpfs counted in its memory; nothing
  else of the host's file system (so no path-based Unix socket of the host) is there;
- an unprivileged user (`nobody`) in a user namespace of its own, where the kernel counts RLIMIT_NPROC for this
  call alone, with no-new-privileges; per-process rlimits on CPU time, address space, file size and open files;
- a wall-clock limit, after which every process of the call is killed; stdout and stderr read as they come,
  each kept up to its byte cap and counted beyond it.

Without a usable cgroup the supervisor polls the call's processes and kills them all at the memory or process
limit; without root there are no namespaces and no user drop. The sandbox logs the weaker guarantee it gives
once, when it is made, and `SandboxLimits.require` refuses to run without what a caller needs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pwd
import stat
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

from rollverify.environment.cgroups import CallCgroup, CgroupPlan, resolve_cgroups
from rollverify.environment.launcher import Launcher
from rollverify.environment.limits import SandboxLimits, SandboxUnavailable
from rollverify.environment.result import SandboxResult, failed_result
from rollverify.environment.session import ChannelError, SandboxSession

SYSTEM_PYTHON = "/usr/bin/python3"
MAX_MESSAGE_BYTES = 16 << 20
PROBE_LIMITS = SandboxLimits(wall_seconds=30)
# Polling period of the accounting that stands in for a cgroup (a PID namespace's /proc is small; the host's
# is not).
POLL_S = {True: 0.02, False: 0.05}
log = logging.getLogger(__name__)


class SandboxStartError(OSError):
    """The machine could not start a call (a fork, a pipe or the call's cgroup failed)."""

__all__ = [
    "ChannelError",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSession",
    "SandboxStartError",
    "SandboxUnavailable",
    "namespaces_available",
]


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the machine gave a trial call: namespaces (mount, PID, network...), a user namespace, and why not."""

    namespaces: bool
    userns: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Launched:
    """A started call's supervisor (its pid is the call's process group) and the caller's ends of its pipes."""

    pid: int
    stdout: int
    stderr: int
    status: int
    chan: tuple[int, int] | None  # (the program's input: write end, its output: read end)


def _launch(python: str, spec: dict, chan: bool) -> Launched:
    """Start one call's supervisor through the zygote with `spec`."""
    pipes = [os.pipe() for _ in range(5 if chan else 3)]
    # theirs: stdout, stderr, status (write ends), then the channel's read end (to the program) and write end
    theirs = [w for _, w in pipes[:3]] + ([pipes[3][0], pipes[4][1]] if chan else [])
    ours = [r for r, _ in pipes[:3]] + ([pipes[3][1], pipes[4][0]] if chan else [])
    try:
        pid = Launcher.get(python).spawn(spec, theirs)
    except OSError:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    return Launched(pid, ours[0], ours[1], ours[2], (ours[3], ours[4]) if chan else None)


@cache
def probe(python: str, ids: tuple[int, int] | None, host_paths: tuple[str, ...]) -> Probe:
    """Run `pass` once with every isolation, then without the namespaces, to see what this machine allows."""
    if os.geteuid() != 0:
        return Probe(False, False, "not root: no namespaces, no user drop")
    reasons = []
    for namespaces in (True, False):
        for userns in (True, False) if ids is not None else (False,):
            spec = _spec_base(python, ids, namespaces, userns, PROBE_LIMITS, host_paths)
            spec["files"] = {"main.py": "pass\n"} if namespaces else {}
            work = None if namespaces else tempfile.mkdtemp(prefix="rv-sandbox-probe-")
            if work is not None:
                os.chmod(work, 0o755)
                Path(work, "main.py").write_text("pass\n")
                spec.update(program=f"{work}/main.py", cwd=work, env=_env(work))
            try:
                launched = _launch(python, spec, chan=False)
                session = SandboxSession(launched, PROBE_LIMITS, {"pid": "none"}, None, None, time.monotonic(),
                                         MAX_MESSAGE_BYTES)
                session.finish()
                events, err = session.events(), bytes(session.kept[1])
            except OSError as exc:
                events, err = {"error": {"message": repr(exc)}}, b""
            finally:
                if work is not None:
                    subprocess.run(["rm", "-rf", work], check=False)
            if "error" not in events and events.get("exit", {}).get("status") == 0:
                return Probe(namespaces, userns, "; ".join(reasons))
            why = events.get("error", {}).get("message") or err.decode(errors="replace").strip()[-300:] or "no report"
            reasons.append(f"namespaces={namespaces} userns={userns}: {why}")
    return Probe(False, False, "; ".join(reasons))


def _spec_base(
    python: str,
    ids: tuple[int, int] | None,
    namespaces: bool,
    userns: bool,
    lim: SandboxLimits,
    host_paths: tuple[str, ...],
) -> dict:
    cpu = math.ceil(lim.cpu_seconds)
    workdir = "/tmp" if namespaces else None
    return {
        "namespaces": namespaces,
        "userns": userns,
        "uid": ids[0] if ids else None,
        "gid": ids[1] if ids else None,
        "rlimits": {
            "RLIMIT_CPU": [cpu, cpu + 1],
            "RLIMIT_AS": [lim.memory_bytes, lim.memory_bytes],
            "RLIMIT_FSIZE": [lim.file_bytes, lim.file_bytes],
            "RLIMIT_NOFILE": [lim.open_files, lim.open_files],
            "RLIMIT_CORE": [0, 0],
        },
        "nproc": lim.processes if ids is not None else None,
        "python": python,
        "program": f"{workdir}/main.py" if workdir else None,
        "cwd": workdir,
        "env": _env(workdir) if workdir else None,
        "host_paths": list(host_paths),
        "disk_bytes": lim.disk_bytes,
        "cgroup_procs": [],
        "accounting": None,
        "files": {},
        "wall_seconds": lim.wall_seconds,
    }


def _env(work: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}


@cache
def _cgroups(mode: str, parent: str | None) -> tuple[CgroupPlan | None, str]:
    return resolve_cgroups(mode, parent)


@cache
def namespaces_available() -> bool:
    """Whether calls get their own namespaces here (root, with the system interpreter and the default user)."""
    if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
        return False
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return False
    return probe(SYSTEM_PYTHON, (entry.pw_uid, entry.pw_gid), SandboxLimits().host_paths).namespaces


_warned: set[tuple[tuple[str, str], ...]] = set()


class Sandbox:
    """Runs Python source under one `SandboxLimits`; thread-safe (each call owns its processes, cgroup and pipes)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = lim = limits if limits is not None else SandboxLimits()
        self._user = self._resolve_user()
        self._python = self._resolve_python()
        ids = self._user[1:] if self._user else None
        if lim.namespaces and os.geteuid() == 0:
            self._check_visible(self._python)
        found = probe(self._python, ids, lim.host_paths) if lim.namespaces else Probe(False, False, "turned off")
        self._probe = found
        self._namespaces = found.namespaces
        self._userns = found.userns or (not lim.namespaces and ids is not None and self._userns_alone(ids))
        self._cgroup_plan, self._cgroup_reason = _cgroups(lim.cgroup, lim.cgroup_parent)
        if self._user is not None and not self._namespaces:
            _check_traversable(Path(lim.base_dir or tempfile.gettempdir()), self._user[0])
        missing = [k for k in lim.require if not self._has(k)]
        if missing:
            raise SandboxUnavailable(
                f"the sandbox requires {', '.join(sorted(missing))} isolation and this machine does not give it "
                f"(got {self.isolation}; {self._why()}); run as root on Linux with user namespaces and a "
                "writable cgroup hierarchy, or drop it from SandboxLimits.require"
            )
        self._announce()

    def _userns_alone(self, ids: tuple[int, int]) -> bool:
        return probe(self._python, ids, self.limits.host_paths).userns

    @property
    def isolation(self) -> dict[str, str]:
        ns = "namespace" if self._namespaces else "none"
        return {
            "network": ns,
            "pid": ns,
            "mount": ns,
            "user": self._user[0] if self._user is not None else "same",
            "userns": "namespace" if self._userns else "none",
            "limits": self._cgroup_plan.name if self._cgroup_plan is not None else "accounting",
            "python": self._python,
        }

    def _has(self, kind: str) -> bool:
        if kind == "cgroup":
            return self._cgroup_plan is not None
        if kind == "user":
            return self._user is not None
        if kind == "userns":
            return self._userns
        return self._namespaces

    def _why(self) -> str:
        parts = [f"namespaces: {self._probe.reason}"] if self._probe.reason else []
        if self._cgroup_plan is None:
            parts.append(f"cgroups: {self._cgroup_reason}")
        return "; ".join(parts) or "all isolations available"

    def guarantees(self) -> list[str]:
        """What a call here is and is not held to, one line each (logged at start when weaker than the full set)."""
        iso, lim = self.isolation, self.limits
        out = []
        if iso["limits"] == "accounting":
            out.append(
                f"memory ({lim.memory_bytes >> 20} MiB) and processes ({lim.processes}) of the whole call are "
                "polled and the call killed at a limit, not enforced by a cgroup: a burst between two polls can pass "
                f"the limit (why: {self._cgroup_reason})"
            )
        if iso["pid"] == "none":
            out.append(
                "no PID, mount or network namespace: the program sees the host's processes, files and network, and "
                "a process that leaves the call's process group escapes the accounting and the clean-up"
            )
        if iso["user"] == "same":
            out.append("no user drop: the program runs as the caller and can do whatever the caller can")
        elif iso["userns"] == "none":
            out.append("no user namespace: RLIMIT_NPROC counts every call of the sandbox user together")
        return out

    def _announce(self) -> None:
        key = tuple(sorted(self.isolation.items()))
        if key in _warned:
            return
        _warned.add(key)
        weaker = self.guarantees()
        if weaker:
            log.warning("sandbox: weaker isolation on this machine (%s): %s", self._why(), " | ".join(weaker))
        else:
            log.info("sandbox: %s", self.isolation)

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
        """The caller's interpreter when the program runs as the caller on the host's file system; else the
        system's, which the sandbox user can read and the private root holds (/usr)."""
        if self.limits.python is not None:
            return self.limits.python
        private_root = self.limits.namespaces and os.geteuid() == 0
        if self._user is None and not private_root:
            return sys.executable
        if not os.access(SYSTEM_PYTHON, os.X_OK):
            raise SandboxUnavailable(
                f"the sandbox runs the program as {self._user[0] if self._user else 'root'} in its own root and needs "
                f"an interpreter there; {SYSTEM_PYTHON} does not exist here (the caller's {sys.executable} may not "
                "be readable or under host_paths). Install python3 or set SandboxLimits.python"
            )
        return SYSTEM_PYTHON

    def _check_visible(self, python: str) -> None:
        real = os.path.realpath(python)
        roots = [os.path.realpath(p) for p in self.limits.host_paths]
        if not any(real == r or real.startswith(r + "/") for r in roots):
            raise SandboxUnavailable(
                f"the interpreter {python} ({real}) is not under SandboxLimits.host_paths {self.limits.host_paths}, "
                "so the program could not run in its private root; add its folder there"
            )

    # --- calls -----------------------------------------------------------------------------------------------

    def run(self, code: str, *, files: dict[str, str] | None = None) -> SandboxResult:
        """Run `code` as a program (`main.py` in the call's folder, beside `files`); never raises for what it does."""
        started = time.monotonic()
        try:
            session = self.start(code, files=files, channel=False)
        except SandboxStartError as exc:
            return failed_result(str(exc), time.monotonic() - started, self.limits, self.isolation)
        return session.finish()

    def start(
        self,
        code: str,
        *,
        files: dict[str, str] | None = None,
        channel: bool = True,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> SandboxSession:
        """Start `code`; with `channel` the program reads messages on descriptor 3 and writes them on 4 (frames of
        `wire`). SandboxStartError when the machine cannot start it (no process, no cgroup)."""
        started = time.monotonic()
        everything = {**(files or {}), "main.py": code}
        for name in everything:
            if os.path.isabs(name) or ".." in Path(name).parts or not name.strip():
                raise ValueError(f"sandbox file name {name!r} leaves the call's folder; use a relative name")
        lim = self.limits
        ids = self._user[1:] if self._user else None
        spec = _spec_base(self._python, ids, self._namespaces, self._userns, lim, lim.host_paths)
        work: Path | None = None
        cgroup: CallCgroup | None = None
        try:
            if self._namespaces:
                spec["files"] = everything
            else:
                work = Path(tempfile.mkdtemp(prefix="rv-sandbox-", dir=lim.base_dir))
                self._populate(work, everything)
                spec.update(program=str(work / "main.py"), cwd=str(work), env=_env(str(work)))
            if self._cgroup_plan is not None:
                cgroup = CallCgroup.create(self._cgroup_plan, lim.memory_bytes, lim.processes, lim.cpus)
                spec["cgroup_procs"] = cgroup.procs_files()
            else:
                spec["accounting"] = {
                    "memory": lim.memory_bytes, "processes": lim.processes, "poll_s": POLL_S[self._namespaces],
                }  # fmt: skip
            launched = _launch(self._python, spec, chan=channel)
        except OSError as exc:
            if cgroup is not None:
                cgroup.close()
            if work is not None:
                subprocess.run(["rm", "-rf", str(work)], check=False)
            raise SandboxStartError(f"could not start the sandbox: {exc}") from exc
        return SandboxSession(launched, lim, self.isolation, cgroup, work, started, max_message_bytes)

    def _populate(self, work: Path, files: dict[str, str]) -> None:
        for name, text in files.items():
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


def _check_traversable(base: Path, user: str) -> None:
    """The sandbox user reaches its folder under `base` only if every folder above it lets others pass."""
    for folder in [base.resolve(), *base.resolve().parents]:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            raise SandboxUnavailable(
                f"the sandbox user {user!r} cannot reach folders under {base}: {folder} is not searchable by "
                "others; set SandboxLimits.base_dir (or TMPDIR) to a folder like /tmp"
            )
