"""The sandbox's limits and requirements, validated when made (a bad value names its field and what to set)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

MIB = 1 << 20
ISOLATION_KINDS = ("network", "pid", "mount", "user", "userns", "cgroup")
CGROUP_MODES = ("auto", "v1", "v2", "off")
HOST_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(RuntimeError):
    """The machine cannot give the sandbox what its limits require (a user, an interpreter, an isolation)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed call. Memory and processes hold for the whole call (all its processes together).

    cpu_seconds: CPU time of each process (RLIMIT_CPU, rounded up to whole seconds: SIGXCPU there, SIGKILL 1 s on).
    wall_seconds: wall-clock time of the call; past it every process of the call is killed.
    memory_bytes: memory of the whole call: its processes, its /tmp and /dev/shm (a cgroup's memory limit, or
        polled accounting with a kill where no cgroup can be made); each process's address space is capped at it
        too (RLIMIT_AS), so one oversized allocation fails with MemoryError instead of a kill.
    processes: processes and threads of the whole call (a cgroup's pids.max, and RLIMIT_NPROC counted in the call's
        own user namespace; else polled accounting with a kill).
    cpus: CPU bandwidth of the call in cores (a cgroup's CPU quota; None: no quota). Calls running at once also
        share the CPU fairly by call, not by process, where the cpu controller is there.
    file_bytes: largest file a process may write (RLIMIT_FSIZE; beyond it the write fails with EFBIG).
    disk_bytes: size of the call's private /tmp (its working folder) and, separately, of its /dev/shm; both are
        memory, counted in memory_bytes.
    open_files: open file descriptors per process (RLIMIT_NOFILE).
    stdout_bytes, stderr_bytes: bytes of each stream kept; the rest is read, counted and dropped.
    user: the unprivileged user a root caller drops to (None: stay the caller).
    namespaces: run in new network, PID, mount, IPC and UTS namespaces (and a user namespace per call) where the
        machine allows it.
    cgroup: "auto" (v2 where it offers memory and pids, else v1 where both are mounted and writable), "v1", "v2",
        or "off" (polled accounting only).
    cgroup_parent: the cgroup under which each call's cgroup is made (a path below the hierarchy's mount, e.g.
        "/rollverify"); None: the caller's own cgroup.
    host_paths: host folders the program sees, read-only, in its private root (with namespaces); nothing else of
        the host's file system is there.
    require: isolations without which the sandbox refuses to start (see ISOLATION_KINDS).
    python: the interpreter of the program (None: /usr/bin/python3 when dropping user, else the caller's).
    base_dir: where the per-call folders are made without a mount namespace (None: the system temporary folder).
    """

    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_bytes: int = 1024 * MIB
    processes: int = 64
    cpus: float | None = 1.0
    file_bytes: int = 16 * MIB
    disk_bytes: int = 64 * MIB
    open_files: int = 64
    stdout_bytes: int = 64 * 1024
    stderr_bytes: int = 16 * 1024
    user: str | None = "nobody"
    namespaces: bool = True
    cgroup: str = "auto"
    cgroup_parent: str | None = None
    host_paths: tuple[str, ...] = HOST_PATHS
    require: tuple[str, ...] = ()
    python: str | None = None
    base_dir: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("cpu_seconds", "wall_seconds"):
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    raise ValueError(
                        f"SandboxLimits.{f.name} must be a positive number of seconds; got {value!r}"
                    )
            elif f.name in (
                "memory_bytes",
                "processes",
                "file_bytes",
                "disk_bytes",
                "open_files",
                "stdout_bytes",
                "stderr_bytes",
            ):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"SandboxLimits.{f.name} must be a positive integer; got {value!r}")
        if self.memory_bytes < 32 * MIB:
            raise ValueError(
                f"SandboxLimits.memory_bytes={self.memory_bytes} is below 32 MiB, too little for the interpreter "
                "to start; give it at least 32 MiB (64 MiB or more for real programs)"
            )
        if self.processes < 2:
            raise ValueError(
                f"SandboxLimits.processes must be at least 2 (the program and its interpreter's helper); "
                f"got {self.processes}"
            )
        if self.cpus is not None and (
            isinstance(self.cpus, bool) or not isinstance(self.cpus, int | float) or not 0.01 <= self.cpus <= 1024
        ):
            raise ValueError(f"SandboxLimits.cpus must be None or a number of cores in [0.01, 1024]; got {self.cpus!r}")
        if self.open_files < 8:
            raise ValueError(
                f"SandboxLimits.open_files must be at least 8 (stdio and the interpreter's own); got {self.open_files}"
            )
        bad = [r for r in self.require if r not in ISOLATION_KINDS]
        if not isinstance(self.require, tuple) or bad:
            raise ValueError(
                f"SandboxLimits.require must be a tuple of {', '.join(ISOLATION_KINDS)}; got {self.require!r}"
            )
        if self.cgroup not in CGROUP_MODES:
            raise ValueError(f"SandboxLimits.cgroup must be one of {', '.join(CGROUP_MODES)}; got {self.cgroup!r}")
        if self.cgroup_parent is not None and not (
            isinstance(self.cgroup_parent, str) and self.cgroup_parent.startswith("/")
        ):
            raise ValueError(
                "SandboxLimits.cgroup_parent must be None or a cgroup path starting with '/' (below the "
                f"hierarchy's mount); got {self.cgroup_parent!r}"
            )
        if not isinstance(self.host_paths, tuple) or not all(
            isinstance(p, str) and os.path.isabs(p) and os.path.normpath(p) == p and p != "/" for p in self.host_paths
        ):
            raise ValueError(
                "SandboxLimits.host_paths must be a tuple of absolute, normalised folder paths other than '/'; "
                f"got {self.host_paths!r}"
            )
        if self.user is not None and (not isinstance(self.user, str) or not self.user):
            raise ValueError(f"SandboxLimits.user must be a user name or None; got {self.user!r}")
        if self.python is not None and not os.path.isabs(self.python):
            raise ValueError(
                f"SandboxLimits.python must be an absolute path to an interpreter; got {self.python!r}"
            )
        if self.base_dir is not None and not os.path.isdir(self.base_dir):
            raise ValueError(
                f"SandboxLimits.base_dir={self.base_dir!r} is not a folder; create it or leave it None"
            )
