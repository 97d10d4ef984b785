"""A cgroup per sandboxed call: memory, process count and CPU held across all of the call's processes.

`resolve_cgroups` picks the hierarchy once per `Sandbox`: cgroup v2 where a cgroup2 mount offers the memory and
pids controllers (GPU nodes usually), else cgroup v1 where both controllers are mounted and a cgroup can be made
under the parent (these CPU machines). The parent is `SandboxLimits.cgroup_parent` or the caller's own cgroup, so a
container's or a job's limits still hold above every call. Under v2 the parent must hand the controllers down
(`cgroup.subtree_control`); a cgroup that holds processes cannot, so when the caller is the only process of its own
cgroup it moves itself into a leaf beside the calls (as nsjail does), and otherwise the sandbox falls back to
polled accounting and says why.

`CallCgroup` is one call's cgroup: made and limited by the caller before the call starts, joined by the call's
supervisor before it forks anything, read (peak memory, OOM kills, refused forks), emptied and removed after.
Every path goes through a `CgroupFS`, so the v2 logic runs in unit tests on a fake tree where v2 is not mounted.
"""

from __future__ import annotations

import errno
import itertools
import os
import secrets
import signal
import time
from dataclasses import dataclass, field

NEEDED = ("memory", "pids")
PREFIX = "rv-sandbox-"
# The call's supervisors (two small interpreters) are in its cgroup beside the program.
SUPERVISOR_PROCESSES = 2
CPU_PERIOD_US = 100_000
_counter = itertools.count()


class CgroupFS:
    """The file operations cgroups need, every absolute path under `root` (a fake tree in tests)."""

    def __init__(self, root: str = "") -> None:
        self.root = root.rstrip("/")

    def path(self, p: str) -> str:
        return self.root + p

    def read(self, p: str) -> str:
        with open(self.path(p)) as f:
            return f.read()

    def write(self, p: str, text: str) -> None:
        with open(self.path(p), "w") as f:
            f.write(text)

    def exists(self, p: str) -> bool:
        return os.path.exists(self.path(p))

    def mkdir(self, p: str) -> None:
        os.mkdir(self.path(p), 0o755)

    def rmdir(self, p: str) -> None:
        os.rmdir(self.path(p))

    def listdir(self, p: str) -> list[str]:
        return os.listdir(self.path(p))

    def getpid(self) -> int:
        return os.getpid()


@dataclass(frozen=True)
class Mount:
    fstype: str
    point: str
    root: str
    options: frozenset[str]


def mounts(fs: CgroupFS) -> list[Mount]:
    """cgroup and cgroup2 mounts of this process's mount namespace (/proc/self/mountinfo)."""
    found = []
    for line in fs.read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) < 5 or len(b) < 3 or b[0] not in ("cgroup", "cgroup2"):
            continue
        found.append(Mount(b[0], _unescape(a[4]), _unescape(a[3]), frozenset(b[2].split(","))))
    return found


def own_cgroups(fs: CgroupFS) -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path (/proc/self/cgroup)."""
    paths = {}
    for line in fs.read("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _on_disk(m: Mount, cgroup_path: str) -> str | None:
    """Where cgroup `cgroup_path` of the hierarchy is in the mount `m` (None: outside what is mounted)."""
    if m.root == "/":
        rel = cgroup_path
    elif cgroup_path == m.root or cgroup_path.startswith(m.root + "/"):
        rel = cgroup_path[len(m.root) :]
    else:
        return None
    return m.point.rstrip("/") + (rel if rel != "/" else "")


@dataclass(frozen=True)
class CgroupPlan:
    """Where each call's cgroup is made: `parents` maps controller (v2: "unified") to the parent folder."""

    version: int
    parents: dict[str, str]
    cpu: bool
    fs: CgroupFS = field(default_factory=CgroupFS, compare=False, repr=False)

    @property
    def name(self) -> str:
        return f"cgroup-v{self.version}"


def resolve_cgroups(mode: str, parent: str | None, fs: CgroupFS | None = None) -> tuple[CgroupPlan | None, str]:
    """The cgroup plan for `mode` ("auto", "v1", "v2", "off") and the reason when there is none."""
    fs = fs or CgroupFS()
    if mode == "off":
        return None, "cgroups turned off (SandboxLimits.cgroup='off')"
    try:
        found, own = mounts(fs), own_cgroups(fs)
    except OSError as exc:
        return None, f"cannot read this process's cgroups: {exc}"
    reasons = []
    for version in (2, 1) if mode == "auto" else (int(mode[1]),):
        try:
            plan = _resolve_v2(fs, found, own, parent) if version == 2 else _resolve_v1(fs, found, own, parent)
        except _NoCgroup as exc:
            reasons.append(f"v{version}: {exc}")
            continue
        _sweep(plan)
        return plan, ""
    return None, "; ".join(reasons)


class _NoCgroup(Exception):
    pass


def _resolve_v2(fs: CgroupFS, found: list[Mount], own: dict[str, str], parent: str | None) -> CgroupPlan:
    mount = next((m for m in found if m.fstype == "cgroup2"), None)
    if mount is None:
        raise _NoCgroup("no cgroup2 hierarchy is mounted")
    target = parent or own.get("")
    folder = _on_disk(mount, target) if target else None
    if folder is None:
        raise _NoCgroup(f"cgroup {target or '(the caller has none under v2)'} is not under the cgroup2 mount at "
                        f"{mount.point}")
    try:
        available = fs.read(folder + "/cgroup.controllers").split()
    except OSError as exc:
        raise _NoCgroup(f"cannot read {folder}/cgroup.controllers: {exc}") from None
    missing = [c for c in NEEDED if c not in available]
    if missing:
        raise _NoCgroup(f"{folder} is not given the {', '.join(missing)} controller(s) by its parent")
    wanted = [*NEEDED, *(["cpu"] if "cpu" in available else [])]
    _enable_subtree(fs, folder, wanted, moving_self=parent is None)
    _probe(fs, folder)
    return CgroupPlan(2, {"unified": folder}, "cpu" in wanted, fs)


def _enable_subtree(fs: CgroupFS, folder: str, wanted: list[str], moving_self: bool) -> None:
    """Hand `wanted` down from `folder`; a cgroup holding processes cannot (EBUSY), so the caller moves itself
    into a leaf first when it is the only one there."""
    if set(wanted) <= set(fs.read(folder + "/cgroup.subtree_control").split()):
        return
    line = " ".join("+" + c for c in wanted)
    try:
        fs.write(folder + "/cgroup.subtree_control", line)
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise _NoCgroup(f"cannot enable {line} in {folder}/cgroup.subtree_control: {exc}") from None
    procs = fs.read(folder + "/cgroup.procs").split()
    if not moving_self or procs != [str(fs.getpid())]:
        raise _NoCgroup(
            f"{folder} holds processes ({len(procs)}), so it cannot hand controllers to the calls' cgroups; set "
            "SandboxLimits.cgroup_parent to an empty delegated cgroup (e.g. one made by systemd-run -p Delegate=yes)"
        )
    leaf = folder + "/rollverify-caller"
    try:
        if not fs.exists(leaf):
            fs.mkdir(leaf)
        fs.write(leaf + "/cgroup.procs", str(fs.getpid()))
        fs.write(folder + "/cgroup.subtree_control", line)
    except OSError as exc:
        raise _NoCgroup(f"cannot move the caller into {leaf} and enable {line}: {exc}") from None


def _resolve_v1(fs: CgroupFS, found: list[Mount], own: dict[str, str], parent: str | None) -> CgroupPlan:
    parents = {}
    for controller in (*NEEDED, "cpu"):
        mount = next((m for m in found if m.fstype == "cgroup" and controller in m.options), None)
        if mount is None:
            if controller == "cpu":
                continue
            raise _NoCgroup(f"the {controller} controller is not mounted")
        target = parent or own.get(controller, "/")
        folder = _on_disk(mount, target)
        if folder is None:
            raise _NoCgroup(f"cgroup {target!r} is not under the {controller} mount at {mount.point}")
        try:
            _probe(fs, folder)
        except _NoCgroup:
            if controller == "cpu":
                continue
            raise
        parents[controller] = folder
    return CgroupPlan(1, parents, "cpu" in parents, fs)


def _probe(fs: CgroupFS, folder: str) -> None:
    probe = f"{folder}/{PREFIX}probe-{fs.getpid()}-{secrets.token_hex(3)}"
    try:
        fs.mkdir(probe)
        fs.rmdir(probe)
    except OSError as exc:
        raise _NoCgroup(f"cannot make a cgroup under {folder}: {exc}") from None


def _sweep(plan: CgroupPlan) -> None:
    """Remove the cgroups of calls whose caller died mid-call (their names carry the caller's pid)."""
    for folder in set(plan.parents.values()):
        try:
            names = plan.fs.listdir(folder)
        except OSError:
            continue
        for name in names:
            pid = name[len(PREFIX) :].split("-", 1)[0]
            if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                CallCgroup(plan, {c: f"{p}/{name}" for c, p in plan.parents.items()}).close()


class CallCgroup:
    """One call's cgroup (one folder per controller under v1, one folder under v2)."""

    def __init__(self, plan: CgroupPlan, folders: dict[str, str]) -> None:
        self.plan = plan
        self.folders = folders
        self.fs = plan.fs

    @classmethod
    def create(cls, plan: CgroupPlan, memory_bytes: int, processes: int, cpus: float | None) -> CallCgroup:
        name = f"{PREFIX}{plan.fs.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        cg = cls(plan, {c: f"{p}/{name}" for c, p in plan.parents.items()})
        try:
            for folder in cg.folders.values():
                cg.fs.mkdir(folder)
            cg._limit(memory_bytes, processes + SUPERVISOR_PROCESSES, cpus)
        except OSError:
            cg.close()
            raise
        return cg

    def _limit(self, memory: int, pids: int, cpus: float | None) -> None:
        fs, f = self.fs, self.folders
        quota = int(cpus * CPU_PERIOD_US) if cpus is not None else None
        if self.plan.version == 2:
            cg = f["unified"]
            fs.write(cg + "/memory.max", str(memory))
            if fs.exists(cg + "/memory.swap.max"):
                fs.write(cg + "/memory.swap.max", "0")
            fs.write(cg + "/pids.max", str(pids))
            if self.plan.cpu and quota is not None:
                fs.write(cg + "/cpu.max", f"{quota} {CPU_PERIOD_US}")
            return
        fs.write(f["memory"] + "/memory.limit_in_bytes", str(memory))
        if fs.exists(f["memory"] + "/memory.memsw.limit_in_bytes"):
            fs.write(f["memory"] + "/memory.memsw.limit_in_bytes", str(memory))
        fs.write(f["pids"] + "/pids.max", str(pids))
        if "cpu" in f and quota is not None:
            fs.write(f["cpu"] + "/cpu.cfs_period_us", str(CPU_PERIOD_US))
            fs.write(f["cpu"] + "/cpu.cfs_quota_us", str(quota))

    def procs_files(self) -> list[str]:
        """The files a process writes "0" to in order to join the call's cgroup (real paths)."""
        return [self.fs.path(folder + "/cgroup.procs") for folder in self.folders.values()]

    def _stat(self, controller: str, file: str, key: str) -> int | None:
        try:
            for line in self.fs.read(f"{self.folders[controller]}/{file}").splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == key:
                    return int(parts[1])
        except (OSError, KeyError, ValueError):
            pass
        return None

    def _value(self, controller: str, file: str) -> int | None:
        try:
            return int(self.fs.read(f"{self.folders[controller]}/{file}").split()[0])
        except (OSError, KeyError, ValueError, IndexError):
            return None

    def peak_memory(self) -> int | None:
        """Highest memory use of the call (all its processes and its tmpfs pages)."""
        if self.plan.version == 2:
            return self._value("unified", "memory.peak")
        return self._value("memory", "memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        if self.plan.version == 2:
            return self._stat("unified", "memory.events", "oom_kill") or 0
        return self._stat("memory", "memory.oom_control", "oom_kill") or 0

    def forks_refused(self) -> int:
        return self._stat("unified" if self.plan.version == 2 else "pids", "pids.events", "max") or 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for folder in self.folders.values():
            try:
                found.update(int(p) for p in self.fs.read(folder + "/cgroup.procs").split())
            except (OSError, ValueError):
                continue
        return sorted(found)

    def kill(self, deadline_s: float = 10.0) -> int:
        """SIGKILL every process of the call until none is left (its forks are bounded by pids.max); how many."""
        killed: set[int] = set()
        if self.plan.version == 2 and self.fs.exists(self.folders["unified"] + "/cgroup.kill"):
            try:
                self.fs.write(self.folders["unified"] + "/cgroup.kill", "1")
            except OSError:
                pass
        stop = time.monotonic() + deadline_s
        while time.monotonic() < stop:
            pids = [p for p in self.pids() if p not in (0, os.getpid())]
            if not pids:
                break
            for pid in pids:
                killed.add(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)
        return len(killed)

    def close(self) -> None:
        """Kill what is left and remove the folders (a dying process can hold one a moment: retried briefly)."""
        self.kill()
        for folder in self.folders.values():
            for _ in range(200):
                try:
                    self.fs.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(0.005)
