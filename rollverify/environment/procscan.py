"""Finding and killing what is left of a sandboxed call, by a scan of /proc: the clean-up of a call that has no
cgroup (a call with one is emptied through it).

A call's processes are those of its process group and, when it had one, of its PID namespace. The scan refuses
the caller's own group and namespace and never returns the caller, its ancestors or init, so a wrong argument
cannot turn it against the machine.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces): state, ppid, pgrp, ...; None when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
    except OSError:
        return None
    return line[line.rfind(")") + 2 :].split()


def alive(pid: int) -> bool:
    """Running or sleeping, not a zombie waiting for its reaper."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def pids_of_user(uid: int) -> list[int]:
    """Live processes whose real uid is `uid`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid and alive(int(pid)):
                            found.append(int(pid))
                        break
        except OSError:
            continue
    return found


def protected_pids() -> set[int]:
    """This process, its ancestors and init: never a sandbox's, whatever a scan finds."""
    chain = {0, 1, os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        fields = stat_fields(pid)
        if not fields:
            break
        pid = int(fields[1])
    return chain


def sandbox_processes(pgid: int, pid_namespace: str | None) -> list[int]:
    """Live processes in process group `pgid` or in PID namespace `pid_namespace` (as /proc/PID/ns/pid reads)."""
    if pid_namespace is not None and pid_namespace == os.readlink("/proc/self/ns/pid"):
        raise ValueError(
            f"refusing to scan PID namespace {pid_namespace}: it is the caller's own, not a sandbox's"
        )
    if pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"refusing to scan process group {pgid}: it is not a sandbox's")
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fields = stat_fields(pid)
        if fields and len(fields) > 2 and int(fields[2]) == pgid:
            found.append(int(pid))
            continue
        if pid_namespace is not None:
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == pid_namespace:
                    found.append(int(pid))
            except OSError:
                pass
    protected = protected_pids()
    return [p for p in found if p not in protected and alive(p)]


def kill_leftovers(pgid: int, pid_namespace: str | None, deadline_s: float = 10.0) -> int:
    """SIGKILL what `sandbox_processes` finds until a scan finds none (a killed process forks no more, so each
    round leaves only what was forked during the last), or `deadline_s` passes; how many were found."""
    killed: set[int] = set()
    stop = time.monotonic() + deadline_s
    while True:
        pids = sandbox_processes(pgid, pid_namespace)
        if not pids:
            return len(killed)
        if time.monotonic() > stop:
            log.warning("sandbox: %d processes of group %d still alive after %.0f s of killing", len(pids), pgid,
                        deadline_s)
            return len(killed)
        for pid in pids:
            killed.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
