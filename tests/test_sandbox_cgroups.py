"""The per-call cgroup's logic on fake cgroup trees: which hierarchy is chosen from what is mounted, how the
parent hands controllers down under v2 (moving the caller into a leaf when it is alone), which limits a call's
cgroup gets under v1 and v2, and how its figures are read. Runs where v2 is not mounted (these machines); the v1
path also runs for real in tests/test_sandbox.py."""

from __future__ import annotations

import errno
from pathlib import Path

from rollverify.environment.cgroups import CallCgroup, CgroupFS, resolve_cgroups

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate"
# this machine's hybrid layout: v1 controllers, and a cgroup2 mount that offers none of memory and pids
HYBRID = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"""


class FakeFS(CgroupFS):
    """A cgroup tree under a temporary folder; `busy` makes writes to subtree_control fail with EBUSY while the
    folder's cgroup.procs holds processes (the kernel's no-internal-processes rule)."""

    def __init__(self, root: Path, pid: int = 4242, busy: bool = False) -> None:
        super().__init__(str(root))
        self.pid, self.busy = pid, busy

    def getpid(self) -> int:
        return self.pid

    def write(self, p: str, text: str) -> None:
        if self.busy and p.endswith("/cgroup.subtree_control"):
            procs = Path(self.path(p)).with_name("cgroup.procs")
            if procs.exists() and procs.read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy")
        if p.endswith("/cgroup.procs") and "rollverify-caller" in p:
            Path(self.path(p)).parent.parent.joinpath("cgroup.procs").write_text("")  # the caller moved out
        super().write(p, text)


def tree(root: Path, mountinfo: str, cgroup: str, files: dict[str, str]) -> None:
    for path, text in {"/proc/self/mountinfo": mountinfo, "/proc/self/cgroup": cgroup, **files}.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def test_v2_is_chosen_where_it_offers_memory_and_pids(tmp_path):
    job = "/sys/fs/cgroup/job.slice"
    tree(tmp_path, V2_MOUNT, "0::/job.slice\n", {f"{job}/cgroup.controllers": "cpuset cpu io memory pids",
                                                 f"{job}/cgroup.subtree_control": "", f"{job}/cgroup.procs": ""})
    fs = FakeFS(tmp_path)
    plan, why = resolve_cgroups("auto", None, fs)
    assert plan is not None and plan.version == 2 and plan.cpu and why == ""
    assert plan.parents == {"unified": job}
    assert fs.read(f"{job}/cgroup.subtree_control") == "+memory +pids +cpu"
    cg = CallCgroup.create(plan, memory_bytes=256 << 20, processes=16, cpus=1.5)
    (folder,) = cg.folders.values()
    assert folder.startswith(f"{job}/rv-sandbox-4242-")
    assert fs.read(f"{folder}/memory.max") == str(256 << 20) and fs.read(f"{folder}/pids.max") == "18"
    assert fs.read(f"{folder}/cpu.max") == "150000 100000"
    assert cg.procs_files() == [str(tmp_path) + f"{folder}/cgroup.procs"]
    tree(tmp_path, V2_MOUNT, "0::/job.slice\n", {f"{folder}/memory.peak": "123456\n",
                                                 f"{folder}/memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n",
                                                 f"{folder}/pids.events": "max 5\n"})
    assert (cg.peak_memory(), cg.oom_kills(), cg.forks_refused()) == (123456, 2, 5)


def test_v2_moves_the_caller_into_a_leaf_when_it_is_alone_in_its_cgroup(tmp_path):
    job = "/sys/fs/cgroup/job.slice"
    tree(tmp_path, V2_MOUNT, "0::/job.slice\n", {f"{job}/cgroup.controllers": "memory pids",
                                                 f"{job}/cgroup.subtree_control": "", f"{job}/cgroup.procs": "4242\n"})
    fs = FakeFS(tmp_path, busy=True)
    plan, why = resolve_cgroups("v2", None, fs)
    assert plan is not None and not plan.cpu, why
    assert fs.read(f"{job}/rollverify-caller/cgroup.procs") == "4242"
    assert fs.read(f"{job}/cgroup.subtree_control") == "+memory +pids"


def test_v2_with_other_processes_in_the_callers_cgroup_falls_back_and_says_why(tmp_path):
    job = "/sys/fs/cgroup/job.slice"
    tree(tmp_path, V2_MOUNT, "0::/job.slice\n", {f"{job}/cgroup.controllers": "memory pids",
                                                 f"{job}/cgroup.subtree_control": "",
                                                 f"{job}/cgroup.procs": "4242\n77\n"})
    plan, why = resolve_cgroups("auto", None, FakeFS(tmp_path, busy=True))
    assert plan is None
    assert "holds processes (2)" in why and "cgroup_parent" in why and "v1: the memory controller is not mounted" in why


def test_v2_under_a_named_parent_and_a_mount_of_part_of_the_hierarchy(tmp_path):
    # a container sees /sys/fs/cgroup as the hierarchy's /kubepods/pod1; its parent is given by path
    mount = "30 23 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw"
    parent = "/sys/fs/cgroup/sandboxes"
    tree(tmp_path, mount, "0::/kubepods/pod1/app\n", {f"{parent}/cgroup.controllers": "memory pids",
                                                       f"{parent}/cgroup.subtree_control": "memory pids"})
    plan, why = resolve_cgroups("auto", "/kubepods/pod1/sandboxes", FakeFS(tmp_path))
    assert plan is not None and plan.parents == {"unified": parent}, why
    plan, why = resolve_cgroups("auto", "/elsewhere", FakeFS(tmp_path))
    assert plan is None and "not under the cgroup2 mount" in why


def test_v1_is_chosen_on_a_hybrid_machine_whose_v2_offers_nothing(tmp_path):
    own = "/process_api/abc"
    files = {f"/sys/fs/cgroup/memory{own}/memory.memsw.limit_in_bytes": "",
             "/sys/fs/cgroup/pids/pids.max": "max", "/sys/fs/cgroup/unified/cgroup.controllers": "hugetlb",
             "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1"}
    tree(tmp_path, HYBRID, f"9:pids:/\n4:memory:{own}\n1:cpu:/\n0::/\n", files)
    fs = FakeFS(tmp_path)
    plan, why = resolve_cgroups("auto", None, fs)
    assert plan is not None and plan.version == 1 and plan.name == "cgroup-v1" and plan.cpu
    assert plan.parents == {"memory": f"/sys/fs/cgroup/memory{own}", "pids": "/sys/fs/cgroup/pids",
                            "cpu": "/sys/fs/cgroup/cpu"}
    cg = CallCgroup.create(plan, memory_bytes=64 << 20, processes=8, cpus=None)
    mem, pids = cg.folders["memory"], cg.folders["pids"]
    assert fs.read(f"{mem}/memory.limit_in_bytes") == str(64 << 20) and fs.read(f"{pids}/pids.max") == "10"
    assert not fs.exists(f"{cg.folders['cpu']}/cpu.cfs_quota_us")  # no quota asked
    assert len(cg.procs_files()) == 3
    plan, why = resolve_cgroups("v2", None, fs)
    assert plan is None and "not given the memory, pids controller(s)" in why
    (tmp_path / mem.lstrip("/") / "memory.max_usage_in_bytes").write_text("999\n")
    (tmp_path / mem.lstrip("/") / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert (cg.peak_memory(), cg.oom_kills()) == (999, 1)


def test_no_cgroup_when_turned_off_or_nothing_is_mounted(tmp_path):
    assert resolve_cgroups("off", None, FakeFS(tmp_path)) == (None, "cgroups turned off (SandboxLimits.cgroup='off')")
    tree(tmp_path, "22 1 0:5 / / rw - ext4 /dev/vda rw", "0::/\n", {})
    plan, why = resolve_cgroups("auto", None, FakeFS(tmp_path))
    assert plan is None and "no cgroup2 hierarchy is mounted" in why and "memory controller is not mounted" in why


def test_cgroups_of_a_caller_that_died_are_swept(tmp_path):
    job = "/sys/fs/cgroup/job.slice"
    stale = tmp_path / "sys/fs/cgroup/job.slice/rv-sandbox-999999999-3-abc"  # no such process
    mine = tmp_path / "sys/fs/cgroup/job.slice/rv-sandbox-1-3-abc"  # pid 1 is alive
    tree(tmp_path, V2_MOUNT, "0::/job.slice\n", {f"{job}/cgroup.controllers": "memory pids",
                                                 f"{job}/cgroup.subtree_control": "memory pids"})
    stale.mkdir()
    mine.mkdir()
    plan, _ = resolve_cgroups("auto", None, FakeFS(tmp_path))
    assert plan is not None and not stale.exists() and mine.exists()
