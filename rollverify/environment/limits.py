"""The sandbox's limits and requirements, validated when made (a bad value names its field and what to set)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

MIB = 1 << 20
ISOLATION_KINDS = ("network", "pid", "user")


class SandboxUnavailable(RuntimeError):
    """The machine cannot give the sandbox what its limits require (a user, an interpreter, an isolation)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed call.

    cpu_seconds: CPU time of each process (RLIMIT_CPU, rounded up to whole seconds: SIGXCPU there, SIGKILL 1 s on).
    wall_seconds: wall-clock time of the call; past it the whole process group is killed.
    memory_bytes: address space of each process (RLIMIT_AS); an allocation beyond it fails (MemoryError).
    processes: processes and threads of the sandbox user (RLIMIT_NPROC); the kernel enforces it only for a user
        other than root, and counts every process of that user on the machine (concurrent calls share it).
    file_bytes: largest file a process may write (RLIMIT_FSIZE; beyond it SIGXFSZ).
    open_files: open file descriptors per process (RLIMIT_NOFILE).
    stdout_bytes, stderr_bytes: bytes of each stream kept; the rest is read, counted and dropped.
    user: the unprivileged user a root caller drops to (None: stay the caller).
    network_namespace: run in new network and PID namespaces when the machine allows it.
    require: isolations without which the sandbox refuses to start ("network", "pid", "user").
    python: the interpreter of the program (None: /usr/bin/python3 when dropping user, else the caller's).
    base_dir: where the per-call folders are made (None: the system temporary folder).
    """

    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_bytes: int = 1024 * MIB
    processes: int = 64
    file_bytes: int = 16 * MIB
    open_files: int = 64
    stdout_bytes: int = 64 * 1024
    stderr_bytes: int = 16 * 1024
    user: str | None = "nobody"
    network_namespace: bool = True
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
        if self.open_files < 8:
            raise ValueError(
                f"SandboxLimits.open_files must be at least 8 (stdio and the interpreter's own); got {self.open_files}"
            )
        bad = [r for r in self.require if r not in ISOLATION_KINDS]
        if not isinstance(self.require, tuple) or bad:
            raise ValueError(
                f"SandboxLimits.require must be a tuple of {', '.join(ISOLATION_KINDS)}; got {self.require!r}"
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
