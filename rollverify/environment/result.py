"""What one sandboxed call did (`SandboxResult`), and how its end is read from the supervisor's report."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass, field

from rollverify.environment.limits import MIB, SandboxLimits


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed call did. `exit_code` is None when a signal ended the program (`killed_by` names it).

    `peak_memory_bytes` is the whole call's peak (its cgroup's, or the polled accounting's; the program's own
    peak RSS where neither ran); `limit_hit` is "memory" or "processes" when a limit of the whole call was met
    (the kernel's OOM killer in the call's cgroup, or the accounting's kill); `forks_refused` counts forks the
    call's pids limit refused."""

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
    limit_hit: str | None = None
    forks_refused: int = 0
    error: str | None = None
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None and self.limit_hit is None

    def reason(self) -> str:
        """One line on how the call ended, for environment text and logs."""
        lim = self.limits
        if self.error is not None:
            return f"sandbox error: {self.error}"
        if self.timed_out:
            return f"timed out after {lim.wall_seconds:g} s wall time (every process of the call killed)"
        if self.limit_hit == "memory":
            return f"killed: memory limit of {lim.memory_bytes / MIB:g} MiB for the whole call exceeded"
        if self.limit_hit == "processes":
            return f"killed: limit of {lim.processes} processes for the whole call exceeded"
        if self.killed_by == "SIGXCPU" or (self.killed_by == "SIGKILL" and self._cpu_spent()):
            return f"killed: CPU time limit of {lim.cpu_seconds:g} s exceeded"
        if self.killed_by == "SIGXFSZ":
            return f"killed: file size limit of {lim.file_bytes} bytes exceeded"
        if self.killed_by is not None:
            return f"killed by {self.killed_by}"
        if self.exit_code is None:
            return "ended without a report from its supervisor"
        return f"exit code {self.exit_code}"

    def _cpu_spent(self) -> bool:
        return self.cpu_seconds is not None and self.cpu_seconds >= math.ceil(self.limits.cpu_seconds)


def failed_result(error: str, wall: float, limits: SandboxLimits, isolation: dict[str, str]) -> SandboxResult:
    """A call that could not start."""
    return SandboxResult(
        exit_code=None, killed_by=None, stdout="", stderr="", stdout_truncated=False, stderr_truncated=False,
        stdout_bytes=0, stderr_bytes=0, timed_out=False, wall_seconds=wall, cpu_seconds=None,
        peak_memory_bytes=None, isolation=isolation, process_group=-1, pid_namespace=None, error=error,
        limits=limits,
    )  # fmt: skip


def decode_status(status: int | None, killed: bool) -> tuple[int | None, str | None]:
    """(exit code, signal name) of the program from the supervisor's wait status; without one (the supervisor
    never reported it: killed, or it failed before the program ran) the program counts as killed."""
    if status is not None:
        if os.WIFSIGNALED(status):
            return None, signal.Signals(os.WTERMSIG(status)).name
        return os.WEXITSTATUS(status), None
    return None, "SIGKILL" if killed else None
