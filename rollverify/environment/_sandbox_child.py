"""The sandbox's zygote and supervisor: run by `python -I -S -c <this source> <socket fd>`, never imported.

The zygote is one small process per caller (started once, as the caller's user: root in CI) that forks a
supervisor for each call it is sent (the call's spec, a marshalled dict, with its descriptors attached), so a
call costs no interpreter start and no import for its supervisor. The supervisor starts a session of its own
and first joins the call's cgroups, so that everything it forks is counted there. With namespaces it then
unshares mount, PID, network, IPC, UTS and cgroup namespaces and forks the call's init (PID 1 there), which
builds a private root (a tmpfs with the host's `host_paths` bound read-only, a few device nodes, its own
/proc, /tmp and /dev/shm as sized tmpfs), pivots into it and forks the program. The program sets its resource
limits, drops to the unprivileged user, enters a user namespace of its own (where the kernel counts
RLIMIT_NPROC for this call alone), sets no-new-privileges and execs the interpreter. Without namespaces the
supervisor forks the program itself and stays its subreaper.

Where the call has no cgroup, the supervisor polls the call's processes (resident memory, tmpfs use, count)
and kills them all at a limit. It reports events as lines on the status descriptor (each the repr of a dict of
plain values, read back with ast.literal_eval): "start" (namespace, what it got), "limit" (what was exceeded),
"exit" (the program's wait status and resource use), "error" (a set-up step failed: the program never ran).
When init exits the kernel kills every process left in its PID namespace.

Only the standard library of the child interpreter is used: the same file runs under /usr/bin/python3. Its
imports happen once, in the zygote; a call's supervisor is a fork of it.
"""

import ctypes
import fcntl
import marshal
import os
import resource
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")
NEW_ROOT = "/tmp"
# Seconds past its wall limit after which a call kills itself, should its caller be gone.
BACKSTOP_S = 3

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _call(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _prctl(option, value):
    return _libc.prctl(option, value, 0, 0, 0) == 0


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _call(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _report(fd, record):
    try:
        os.write(fd, (repr(record) + "\n").encode())
    except OSError:
        pass


# --- the private root --------------------------------------------------------------------------------------------


def _make_root(spec):
    """Build the call's root under NEW_ROOT (this mount namespace only) and pivot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    r = NEW_ROOT
    _mount("tmpfs", r, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for host in spec["host_paths"]:
        inside = r + host
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if os.path.islink(host):
            os.symlink(os.readlink(host), inside)
        elif os.path.isdir(host):
            os.mkdir(inside)
            _mount(host, inside, None, MS_BIND | MS_REC)
            _mount(None, inside, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.mkdir(r + "/dev")
    for name in DEVICES:
        open(r + "/dev/" + name, "w").close()
        _mount("/dev/" + name, r + "/dev/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, r + "/dev/" + name)
    uid, gid = spec["uid"], spec["gid"]
    owner = f",uid={uid},gid={gid}" if uid is not None else ""
    size = spec["disk_bytes"]
    os.mkdir(r + "/dev/shm")
    _mount("tmpfs", r + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    os.mkdir(r + "/tmp")
    _mount("tmpfs", r + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=700{owner}")
    os.mkdir(r + "/proc")
    _mount("proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _write_files(r + "/tmp", spec)
    os.mkdir(r + "/.old")
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {os.uname().machine}")
    _call(_libc.syscall(number, r.encode(), (r + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _call(_libc.umount2(b"/.old", MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _write_files(folder, spec):
    for name, text in spec["files"].items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        if spec["uid"] is not None:
            os.chown(path, spec["uid"], spec["gid"])
            parent = os.path.dirname(path)
            while parent != folder:
                os.chown(parent, spec["uid"], spec["gid"])
                parent = os.path.dirname(parent)


# --- the program -------------------------------------------------------------------------------------------------


def _fds_to(chan, first):
    """Move the channel's descriptors to first, first+1 and close every other one above stderr."""
    if chan:
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in chan]
        for i, fd in enumerate(high):
            os.dup2(fd, first + i)
        keep = first + len(chan)
    else:
        keep = first
    os.closerange(keep, 1 << 16)
    if not chan:
        os.closerange(3, keep)


def _exec_program(spec):
    """In the forked child: descriptors, limits, privileges, user namespace, exec; any failure exits 126."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        _fds_to(spec["chan"], 3)
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.umask(0o077)
        uid, gid = spec["uid"], spec["gid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        if spec["userns"]:
            # Dropping the user made /proc/self root's; the maps below are written by this process itself.
            _prctl(PR_SET_DUMPABLE, 1)
            _call(_libc.unshare(CLONE_NEWUSER), "unshare a user namespace")
            for file, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open("/proc/self/" + file, "w") as f:
                    f.write(line)
        if spec["nproc"] is not None:
            # Set after the user namespace exists: its parent-level count then keeps the caller's limit.
            resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.chdir(spec["cwd"])
        os.execve(spec["python"], [spec["python"], "-I", "-B", spec["program"]], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - the child must never return into the supervisor's code
        os.write(2, f"sandbox: could not start the program: {exc!r}\n".encode())
    os._exit(126)


# --- accounting without a cgroup ---------------------------------------------------------------------------------


def _call_pids(namespaced):
    """The call's live processes other than this supervisor: all of its PID namespace, else of its group."""
    me, group, found = os.getpid(), os.getpgrp(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] in ("Z", "X"):
            continue
        if namespaced or int(fields[2]) == group:
            found.append((int(name), int(fields[21]) * resource.getpagesize()))
    return found


def _tmpfs_bytes(namespaced):
    used = 0
    for path in ("/tmp", "/dev/shm") if namespaced else ():
        try:
            st = os.statvfs(path)
            used += (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            pass
    return used


class Accounting:
    """Polled memory (resident + tmpfs) and process count over the call, with a kill of all at a limit."""

    def __init__(self, spec, namespaced):
        self.memory, self.processes = spec["accounting"]["memory"], spec["accounting"]["processes"]
        self.poll_s = spec["accounting"]["poll_s"]
        self.namespaced = namespaced
        self.peak = 0

    def check(self):
        """None, or the limit that was exceeded (everything of the call has been killed then)."""
        procs = _call_pids(self.namespaced)
        used = sum(rss for _, rss in procs) + _tmpfs_bytes(self.namespaced)
        self.peak = max(self.peak, used)
        if used > self.memory:
            hit = {"event": "limit", "what": "memory", "bytes": used, "limit": self.memory}
        elif len(procs) > self.processes:
            hit = {"event": "limit", "what": "processes", "count": len(procs), "limit": self.processes}
        else:
            return None
        self.kill_all()
        return hit

    def kill_all(self):
        for _ in range(100):
            procs = _call_pids(self.namespaced)
            if not procs:
                return
            for pid, _ in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


# --- supervision -------------------------------------------------------------------------------------------------


def _children():
    pids = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def _kill_descendants():
    """Kill and reap whatever came to this subreaper, until it has no child left."""
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.wait4(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _supervise(spec, status_fd, namespaced):
    """Fork the program, reap until it ends (polling the limits where there is no cgroup), report its end."""
    accounting = Accounting(spec, namespaced) if spec["accounting"] else None
    if accounting:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    program = os.fork()
    if program == 0:
        _exec_program(spec)
    for fd in spec["chan"] or ():
        os.close(fd)
    exit_record = None
    while exit_record is None:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG if accounting else 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == program:
            exit_record = {"event": "exit", "status": status, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                           "maxrss_kib": usage.ru_maxrss}
        elif pid == 0 and accounting:
            hit = accounting.check()
            if hit:
                _report(status_fd, hit)
            signal.sigtimedwait([signal.SIGCHLD], accounting.poll_s)
    if accounting:
        exit_record = {**(exit_record or {"event": "exit", "status": None}), "peak_bytes": accounting.peak}
    _report(status_fd, exit_record or {"event": "exit", "status": None})
    if accounting:
        accounting.kill_all()
    if not namespaced:
        _kill_descendants()


def _init(spec, status_fd):
    """PID 1 of the call's namespaces: its root, then the program."""
    try:
        _make_root(spec)
        _libc.sethostname(b"sandbox", 7)
    except (SetupError, OSError) as exc:
        _report(status_fd, {"event": "error", "message": f"could not build the call's private root: {exc}"})
        os._exit(1)
    _report(status_fd, {"event": "start", "pid_ns": os.readlink("/proc/self/ns/pid")})
    _supervise(spec, status_fd, namespaced=True)
    os._exit(0)


def _supervisor(spec):
    """The call's supervisor, in its own session: cgroup, namespaces, init (or the program itself without them)."""
    status_fd = spec["status_fd"]
    # If the caller is gone, nothing kills the call at its wall limit: this alarm does, a little later.
    signal.signal(signal.SIGALRM, lambda *_: os.killpg(os.getpgrp(), signal.SIGKILL))
    signal.alarm(int(spec["wall_seconds"]) + BACKSTOP_S)
    try:
        for procs in spec["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")
    except OSError as exc:
        _report(status_fd, {"event": "error", "message": f"could not join the call's cgroup: {exc}"})
        os._exit(1)
    if not spec["namespaces"]:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _report(status_fd, {"event": "start", "pid_ns": None})
        _supervise(spec, status_fd, namespaced=False)
        os._exit(0)
    try:
        # after joining the cgroups: the cgroup namespace's root is the call's own cgroup
        _call(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP),
              "unshare the call's namespaces")
    except SetupError as exc:
        _report(status_fd, {"event": "error", "message": str(exc)})
        os._exit(1)
    init = os.fork()
    if init == 0:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _init(spec, status_fd)
    for fd in [*(spec["chan"] or ()), status_fd]:
        os.close(fd)
    while True:
        try:
            os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            break
    os._exit(0)


# --- the zygote --------------------------------------------------------------------------------------------------


def _recv_exact(sock, n):
    data, fds = b"", []
    while len(data) < n:
        chunk, more, _, _ = socket.recv_fds(sock, n - len(data), 16)
        if not chunk:
            return None, fds
        data += chunk
        fds += more
    return data, fds


def _zygote(sock_fd):
    """Fork one supervisor per request until the caller closes its end. A request is 8 bytes of length with the
    call's descriptors attached (stdout, stderr, status, then the channel's two if any), then the marshalled spec;
    the answer is the supervisor's pid (8 bytes). Children are reaped as they end."""
    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        header, fds = _recv_exact(sock, 8)
        if header is None:
            os._exit(0)
        body, more = _recv_exact(sock, int.from_bytes(header, "big"))
        fds += more
        if body is None:
            os._exit(0)
        spec = marshal.loads(body)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                null = os.open("/dev/null", os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(fds[0], 1)
                os.dup2(fds[1], 2)
                spec["status_fd"], spec["chan"] = fds[2], fds[3:5] or None
                for fd in (null, fds[0], fds[1]):
                    os.close(fd)
                _supervisor(spec)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        sock.sendall(pid.to_bytes(8, "big"))


_zygote(int(sys.argv[1]))
