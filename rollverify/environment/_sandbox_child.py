"""The sandbox's in-box supervisor: run by `python -I -c <this source> <json spec>`, never imported.

It runs as the caller's user (root in CI), inside the new network and PID namespaces when the sandbox got them
(then it is PID 1 there, and the kernel kills everything left in the namespace when it exits). It forks the user's
program, which sets its resource limits, drops to the unprivileged user and execs the interpreter on the program
file; the supervisor reaps every process that comes to it until that program ends, then reports the program's
wait status and resource use as one JSON line on the status descriptor and exits.

Only the standard library of the child interpreter is used: the same file runs under /usr/bin/python3.
"""

import ctypes
import json
import os
import resource
import sys

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _report(fd: int, record: dict) -> None:
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def _exec_program(spec: dict, status_fd: int) -> None:
    """In the forked child: limits, privileges, then exec; any failure exits 126 with the reason on stderr."""
    try:
        os.close(status_fd)
        for name, value in spec["rlimits"].items():
            soft, hard = value
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.umask(0o077)
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        if spec["no_new_privs"]:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.execve(spec["python"], [spec["python"], "-I", "-B", spec["program"]], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - the child must never return into the supervisor's code
        os.write(2, f"sandbox: could not start the program: {exc!r}\n".encode())
    os._exit(126)


def _children() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def _kill_descendants() -> None:
    """Kill and reap whatever came to this subreaper, until it has no child left (the process limit bounds it)."""
    while True:
        for pid in _children():
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        try:
            os.wait4(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _report(status_fd, {"event": "start", "pid_ns": os.readlink("/proc/self/ns/pid"), "pid": os.getpid()})
    program = os.fork()
    if program == 0:
        _exec_program(spec, status_fd)
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == program:
            _report(
                status_fd,
                {
                    "event": "exit",
                    "status": status,
                    "cpu_seconds": usage.ru_utime + usage.ru_stime,
                    "maxrss_kib": usage.ru_maxrss,
                },
            )
            break
    if not spec["pid_namespace"]:
        # In a PID namespace this process is its init: its exit makes the kernel kill every process left there
        # (and /proc, the host's, names them by host pids, which mean other processes in here).
        _kill_descendants()
    os._exit(0)


main()
