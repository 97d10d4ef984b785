"""Chaos run: the tiny loop for N steps while a seeded schedule kills its servers, trainer ranks and driver.

    python tools/chaos.py --out runs/chaos --steps 60 --seed 0            # the documented run (docs/results.md)
    python tools/chaos.py --out /tmp/c --steps 12 --servers 1 --ranks 1 --drivers 1 --fill 0   # a short one

`rollverify train` (the tiny CPU config, two trainer ranks, one launched SGLang server) runs as a child of this
script. Each fault fires once the run has logged its trigger step (chosen by the seed), a random fraction of a
step later, so it lands anywhere in the next step (rollout, old log-probs, train step, verification, weight push,
checkpoint): `server` SIGKILLs the SGLang server, `rank` one trainer rank, `driver` the driver itself (which is
then started again with `rollverify train --resume OUT`), `fill` fills the checkpoint folder (a tmpfs mounted
there, which needs root; without it the fill is skipped and said so) until a checkpoint has failed, then frees
it. Only processes this script started are killed, by the pid it read from its own child's process tree; it is
the subreaper of everything under it, so a process the dead driver left behind is found and counted.

At the end it audits the run folder (`audit`): the run finished its steps; metrics.jsonl and TensorBoard hold
each step once; the books balance across every restart (every launched response trained once or still in the
final buffer, the ledger exact); the final checkpoint loads (`rollverify export`); no process is left. It prints
and writes OUT.chaos.json (beside the run folder): faults injected and recovered by kind, steps redone, seconds
lost, responses lost, time to detect a dead rank. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
PR_SET_CHILD_SUBREAPER = 36
KINDS = ("server", "rank", "driver", "fill")
RUN = [
    "rollout.batch_groups=2",
    "rollout.n=2",
    "rollout.max_new_tokens=48",
    "rollout.max_live=8",
    "trainer.lr=1e-4",
    "trainer.dp=2",  # two trainer ranks in child processes
    "eval.every=0",
    "log.plots=false",
    "log.export_final=false",
    "trainer.dist_timeout_s=60",
    "trainer.call_timeout_s=300",  # a silent rank (a dead one is noticed at once); start-up on a loaded machine
    "servers.startup_s=900",  # a server start: minutes on a loaded machine
    "servers.engine_args.mem_fraction_static=0.3",  # SGLang's CPU pool check reads free RAM, low on a shared machine
]


def subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap(pids) -> None:
    """Collect the exit status of those of `pids` that came to this process (orphans, as their subreaper); the
    driver's own is left to its Popen."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def is_tracker(pid: int) -> bool:
    """Python's multiprocessing resource tracker (of a driver, or of a rank that started one)."""
    with contextlib.suppress(psutil.Error):
        return "multiprocessing.resource_tracker" in " ".join(psutil.Process(pid).cmdline())
    return False


def pipe_holders(pid: int) -> dict[int, str]:
    """The other processes holding the pipe a resource tracker reads (`main(FD)` in its command line): while one
    lives the tracker cannot see the end of its input."""
    with contextlib.suppress(psutil.Error, OSError, ValueError):
        fd = int(" ".join(psutil.Process(pid).cmdline()).rsplit("main(", 1)[1].split(")", 1)[0])
        pipe = os.readlink(f"/proc/{pid}/fd/{fd}")
        return {p.pid: _command(p.pid) for p in psutil.process_iter() if p.pid != pid and pipe in _fd_targets(p.pid)}
    return {}


def _command(pid: int) -> str:
    """A process's command line, shortened for a report ("" once it is gone)."""
    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline())[:200]
    return ""


def _fd_targets(pid: int) -> set[str]:
    """What a process's file descriptors point at (empty when they cannot be read)."""
    out = set()
    with contextlib.suppress(OSError):
        for f in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                out.add(os.readlink(f))
    return out


def left_behind(pids) -> tuple[list[int], dict[int, dict[int, str]]]:
    """Those of `pids` still alive, and the living processes that keep a resource tracker among them alive, with
    each tracker's holders. A tracker exits by itself, after unlinking what its clients left registered, once it
    reads the end of its pipe, that is once no other process holds the pipe: one without holders is on its way
    out, however long a loaded machine takes it to go; one with holders is kept by them, and they are named."""
    left, holders = [], {}
    for pid in living(pids):
        if not is_tracker(pid):
            left.append(pid)
        elif held := pipe_holders(pid):
            holders[pid] = held
            left += [pid, *(h for h in held if h not in pids)]
    return sorted(set(left)), holders


def living(pids) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def children_of(pid: int, marker: str) -> list[psutil.Process]:
    """The direct children of `pid` whose command line contains `marker`."""
    out = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in psutil.Process(pid).children():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if marker in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
    return out


def read_metrics(out: Path) -> list[dict]:
    rows = []
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def read_faults(out: Path) -> list[dict]:
    rows = []
    with contextlib.suppress(OSError):
        for line in (out / "faults.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def schedule(seed: int, steps: int, counts: dict[str, int], checkpoint_every: int) -> list[dict]:
    """(trigger step, kind, delay in steps) for every fault, seeded; one fault per trigger step, the disk filled
    early enough that a later checkpoint (the last step's) is written again."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS for _ in range(counts[k])]
    rng.shuffle(kinds)
    if len(kinds) > steps - 3:
        raise SystemExit(f"{len(kinds)} faults do not fit in {steps} steps (one per step, from step 2)")
    at = sorted(rng.sample(range(2, steps - 1), len(kinds)))
    if "fill" in kinds and at[kinds.index("fill")] > steps - 2 * checkpoint_every:
        i, j = kinds.index("fill"), 0  # swap it with the first fault
        kinds[i], kinds[j] = kinds[j], kinds[i]
        if at[0] > steps - 2 * checkpoint_every:
            raise SystemExit(f"--steps {steps} leaves no room to fill the disk before the last two checkpoints")
    return [{"step": s, "kind": k, "delay": rng.random()} for s, k in zip(at, kinds, strict=True)]


class Chaos:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.out = a, Path(a.out)
        self.py = a.python or sys.executable
        self.env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.driver: subprocess.Popen | None = None
        self.drivers = 0
        self.events: list[dict] = []
        self.timeline: list[tuple[float, int]] = []  # (time, last logged step)
        self.seen_pids: set[int] = set()
        self.mounted = False
        self.step_s = 0.5
        self.retries = 0  # resumes started again because the server did not start

    # --- processes ----------------------------------------------------------------------------------------

    def start_driver(self, resume: bool, overwrite: bool = False) -> None:
        cmd = [self.py, "-m", "rollverify.app.cli", "train", "--no-progress"]
        if resume:
            cmd += ["--resume", str(self.out)]
        else:
            cmd += ["--overwrite"] if overwrite else []
            cmd += ["--config", "tiny_cpu", "--out", str(self.out), *RUN, f"trainer.steps={self.a.steps}",
                    f"log.checkpoint_every={self.a.checkpoint_every}", f"recovery.max_restarts={self.a.ranks + 2}",
                    f"seed={self.a.seed}"]
            if self.a.endpoint:
                cmd.append(f'servers.endpoints=["{self.a.endpoint}"]')
        log = open(self.out.parent / f"{self.out.name}.driver{self.drivers}.log", "w")  # noqa: SIM115
        self.driver = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=self.env, cwd=ROOT)
        self.drivers += 1
        self.started_at_step = self.last_step()

    def reap(self) -> None:
        reap(self.seen_pids - {self.driver.pid} if self.driver is not None else self.seen_pids)

    def tree(self) -> list[int]:
        if self.driver is None:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            pids = [self.driver.pid] + [p.pid for p in psutil.Process(self.driver.pid).children(recursive=True)]
            self.seen_pids.update(pids)
            return pids
        return []

    def last_step(self) -> int:
        rows = read_metrics(self.out)
        return rows[-1]["step"] if rows else 0

    def poll(self) -> int:
        step = self.last_step()
        self.timeline.append((time.time(), step))
        self.tree()
        self.reap()
        if self.driver is not None and self.driver.poll() not in (None, 0):
            log = self.out.parent / f"{self.out.name}.driver{self.drivers - 1}.log"
            if self.driver.returncode == 3 and self.retries < 5:  # its SGLang server did not start (memory)
                self.retries += 1
                self.events.append({"kind": "retry", "time": time.time(), "reason": f"server start failed ({log})"})
                self.start_again()
                return self.poll()
            raise SystemExit(f"the driver exited with code {self.driver.returncode}; see {log}")
        return step

    # --- faults -------------------------------------------------------------------------------------------

    def wait_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.poll() < step or self.poll() <= self.started_at_step:  # a step logged by this incarnation
            if time.monotonic() > deadline:
                raise SystemExit(f"the run did not reach step {step} within {timeout_s:.0f} s")
            time.sleep(0.05)

    def fire(self, ev: dict) -> dict:
        time.sleep(ev["delay"] * self.step_s)
        rec = {**ev, "at_step": self.last_step()}
        kind = ev["kind"]
        if self.driver.poll() is not None:
            return {**rec, "skipped": "the run had finished"}
        if kind in ("server", "rank"):
            marker = "sglang_ext.server" if kind == "server" else "spawn_main"
            deadline = time.monotonic() + 120
            while not (procs := children_of(self.driver.pid, marker)):  # e.g. ranks restarting
                if time.monotonic() > deadline:
                    raise SystemExit(f"no {kind} process under the driver for 120 s")
                time.sleep(0.1)
            victim = random.Random(self.a.seed + ev["step"]).choice(procs)
            rec.update(pid=victim.pid, time=time.time())
            victim.send_signal(signal.SIGKILL)
        elif kind == "driver":
            rec.update(self.kill_driver())
        elif kind == "fill":
            rec.update(self.fill())
        return rec

    def kill_driver(self) -> dict:
        pids = self.tree()
        t0 = time.time()
        self.driver.send_signal(signal.SIGKILL)
        self.driver.wait()
        deadline = time.monotonic() + 90
        while left_behind(pids)[0] and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.1)
        left, holders = left_behind(pids)
        what = {pid: _command(pid) for pid in left}  # what they are, for the report
        for pid in left:  # counted as a failure below; ours to end all the same
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        self.reap()
        ckpt = json.loads((self.out / "checkpoint" / "loop.json").read_text())["step"] \
            if (self.out / "checkpoint" / "loop.json").is_file() else 0
        rec = {"time": t0, "pid": self.driver.pid, "processes": len(pids), "left_behind": left, "left_what": what,
               "tracker_pipe_holders": holders,
               "exit_s": time.time() - t0, "checkpoint_step": ckpt}
        rec["started_again"] = not self.start_again()
        return rec

    def start_again(self) -> bool:
        """`rollverify train --resume OUT`; before the run's first checkpoint there is nothing to resume, and
        the run starts again (--overwrite: the same bound, every step since the last checkpoint). True: resumed."""
        if (self.out / "checkpoint" / "loop.json").is_file():
            self.start_driver(resume=True)
            return True
        self.start_driver(resume=False, overwrite=True)
        return False

    def fill(self) -> dict:
        if not self.mounted:
            return {"skipped": "the checkpoint folder is not a tmpfs of this script's (needs root)"}
        filler = self.out / "checkpoints" / "chaos-filler"
        before = [f for f in read_faults(self.out) if f["kind"] == "checkpoint"]
        t0 = time.time()
        with open(filler, "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
        deadline = time.monotonic() + 600
        while len([f for f in read_faults(self.out) if f["kind"] == "checkpoint"]) == len(before):
            self.poll()
            if time.monotonic() > deadline or self.driver.poll() is not None:
                break
            time.sleep(0.05)
        filler.unlink()
        return {"time": t0, "held_s": time.time() - t0}

    # --- the run ------------------------------------------------------------------------------------------

    def mount(self) -> None:
        d = self.out / "checkpoints"
        d.mkdir(parents=True, exist_ok=True)
        if self.a.fill and os.geteuid() == 0:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.a.tmpfs_mb}m", "tmpfs", str(d)],
                               capture_output=True, text=True)
            self.mounted = r.returncode == 0

    def unmount(self) -> None:
        """The tmpfs goes; what it holds (the run's checkpoint) moves onto the run folder's own disk first."""
        if not self.mounted:
            return
        d = self.out / "checkpoints"
        keep = self.out.parent / f"{self.out.name}.checkpoints.tmp"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(d, keep, symlinks=True)
        r = subprocess.run(["umount", "-l", str(d)], capture_output=True, text=True)
        if r.returncode:
            print(f"warning: umount {d}: {r.stderr.strip()}", file=sys.stderr)
            return
        for entry in keep.iterdir():
            entry.rename(d / entry.name)
        keep.rmdir()

    def run(self) -> dict:
        if self.out.exists() and any(self.out.iterdir()):
            raise SystemExit(f"--out {self.out} is not empty")
        if self.a.endpoint and self.a.servers:
            raise SystemExit("--endpoint: the run does not launch its server, so --servers must be 0")
        counts = {"server": self.a.servers, "rank": self.a.ranks, "driver": self.a.drivers, "fill": self.a.fill}
        plan = schedule(self.a.seed, self.a.steps, counts, self.a.checkpoint_every)
        self.mount()
        t0 = time.time()
        try:
            self.start_driver(resume=False)
            self.wait_step(1, self.a.timeout_s)
            rows = read_metrics(self.out)
            self.step_s = float(np.median([r["step_s"] for r in rows])) if rows else 0.5
            for ev in plan:
                self.wait_step(ev["step"], self.a.timeout_s)
                self.events.append(self.fire(ev))
                print(json.dumps(self.events[-1]), flush=True)
            deadline = time.monotonic() + self.a.timeout_s
            while self.driver.poll() is None:
                self.poll()
                if time.monotonic() > deadline:
                    raise SystemExit(f"the run did not finish within {self.a.timeout_s:.0f} s after the last fault")
                time.sleep(0.1)
            self.poll()
            wall = time.time() - t0
            time.sleep(2.0)  # what the driver's exit leaves (rank processes closing) has a moment to go
            self.reap()
            report = audit(self.out, self.a.steps, self.py, self.env, load=self.a.load_check)
            report.update(faults_report(self.events, read_faults(self.out), self.timeline, read_metrics(self.out)))
            left, holders = left_behind(self.seen_pids)
            report["processes_left"], report["tracker_pipe_holders"] = left, holders
            report["checks"]["no_process_left"] = not left and not any(e.get("left_behind") for e in self.events)
            report.update(wall_s=wall, seed=self.a.seed, steps=self.a.steps, checkpoint_every=self.a.checkpoint_every,
                          events=self.events, fill_on_tmpfs=self.mounted)
            report["ok"] = all(report["checks"].values())
            return report
        finally:
            if self.driver is not None and self.driver.poll() is None:
                for pid in living(self.tree()):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        psutil.Process(pid).kill()
            self.reap()
            self.unmount()


# --- audit --------------------------------------------------------------------------------------------------


def audit(out: Path, steps: int, python: str, env: dict, load: bool = True) -> dict:
    """The run folder's books after the run (see the module docstring); `checks` holds each verdict."""
    from rollverify.buffer import RolloutBuffer
    from rollverify.rollout import Ledger

    rows = read_metrics(out)
    checks: dict[str, bool] = {}
    logged = [r["step"] for r in rows]
    checks["finished_all_steps"] = bool(logged) and logged[-1] == steps
    checks["metrics_each_step_once"] = logged == list(range(1, steps + 1))
    checks["tensorboard_each_step_once"] = tensorboard_steps(out) == list(range(1, steps + 1))
    trained = [g for r in rows for g in r.get("trained_groups") or []]
    checks["none_trained_twice"] = len(trained) == len(set(trained))
    ckpt = out / "checkpoint"
    state = json.loads((ckpt / "loop.json").read_text())
    buffer = RolloutBuffer.load(ckpt / "buffer.npz")
    ledger = Ledger(**state["ledger"])
    last = rows[-1] if rows else {}
    n = json.loads((out / "config.json").read_text())["rollout"]["n"]
    in_buffer = set(buffer.groups)
    launched = set(range(state["next_group_id"]))
    lost = launched - set(trained) - in_buffer
    checks["checkpoint_is_last_step"] = state["step"] == steps
    checks["every_launched_group_trained_or_buffered"] = not lost and not (set(trained) & in_buffer)
    checks["ledger_matches_metrics"] = all(last.get(f"ledger/{k}") == v for k, v in state["ledger"].items())
    try:
        ledger.check(buffer)
        checks["ledger_exact"] = True
    except AssertionError:
        checks["ledger_exact"] = False
    per_group = {len(g.responses) for g in buffer.groups.values()}
    checks["ledger_counts_groups"] = ledger.launched == n * len(launched) and ledger.trained == n * len(trained) \
        and per_group <= {n}
    error = ""
    if load:  # a fresh trainer loads the final checkpoint and exports its weights
        hf = out.parent / f"{out.name}.final-hf"
        shutil.rmtree(hf, ignore_errors=True)
        r = subprocess.run([python, "-m", "rollverify.app.cli", "export", "--checkpoint", str(out), "--out", str(hf)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        checks["final_checkpoint_loads"] = r.returncode == 0 and any(hf.glob("*.safetensors"))
        error = r.stderr[-2000:] if r.returncode else ""
        shutil.rmtree(hf, ignore_errors=True)
    return {"checks": checks, "responses_lost": n * len(lost), "groups_launched": len(launched),
            "groups_trained": len(trained), "groups_in_final_buffer": len(in_buffer), "ledger": state["ledger"],
            "export_error": error}


def tensorboard_steps(out: Path) -> list[int]:
    """The steps TensorBoard shows for reward_mean (after the purges of rewound steps)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return []
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    if "reward_mean" not in acc.Tags().get("scalars", []):
        return []
    return [e.step for e in acc.Scalars("reward_mean")]


def faults_report(events: list[dict], faults: list[dict], timeline: list[tuple[float, int]], rows: list[dict]) -> dict:
    """Faults injected and recovered by kind, what each cost (steps redone, seconds until the run had logged
    as many steps again as at the fault), and how long the driver took to notice each dead rank."""
    injected = {k: sum(1 for e in events if e["kind"] == k and not e.get("skipped")) for k in KINDS}
    trainer = [f for f in faults if f["kind"] == "trainer"]
    server = [f for f in faults if f["kind"] == "server"]
    ckpt = [f for f in faults if f["kind"] == "checkpoint"]
    step_s = float(np.median([r["step_s"] for r in rows])) if rows else 0.0
    costs, detect = [], []
    for e in events:
        if e.get("skipped") or "time" not in e:
            continue
        before = max((s for t, s in timeline if t <= e["time"]), default=0)
        back = next((t for t, s in timeline if t > e["time"] and s >= before + 1), None)
        cost = {"kind": e["kind"], "at_step": before}
        if back is not None:  # the step in flight at the fault, done again, against a normal step
            cost["seconds_lost"] = max(0.0, back - e["time"] - step_s)
        if e["kind"] == "rank":
            f = next((f for f in trainer if f["detected_at"] >= e["time"] - 1e-3), None)
            if f is not None:  # the restart (and any that failed before it), and the steps done again
                detect.append(f["detected_at"] - e["time"])
                done = next((g for g in trainer if g["detected_at"] >= f["detected_at"] and "restored_step" in g), f)
                cost["steps_redone"] = done.get("steps_redone")
                cost["phase"] = f["phase"]
                cost["seconds_lost"] = (done["time"] - f["detected_at"]) + (done.get("steps_redone") or 0) * step_s
        elif e["kind"] == "driver":
            cost["steps_redone"] = before - e["checkpoint_step"]
            cost["processes_exit_s"] = e["exit_s"]
        elif e["kind"] == "server":
            cost["steps_redone"] = 0
        costs.append(cost)
    recovered = {
        "server": sum(1 for f in server if f["restarted"]),
        "rank": sum(1 for f in trainer if f["action"] == "restart" and "restored_step" in f),
        "driver": sum(1 for e in events if e["kind"] == "driver"),  # each resumed (the run then finished)
        "fill": len(ckpt),
    }
    return {"injected": injected, "recovered": recovered, "costs": costs,
            "steps_redone": sum(c.get("steps_redone") or 0 for c in costs),
            "seconds_lost": sum(c.get("seconds_lost", 0.0) for c in costs),
            "rank_detect_s": {"max": max(detect), "mean": float(np.mean(detect))} if detect else None,
            "trainer_faults": trainer, "checkpoint_faults": ckpt, "step_s_median": step_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run folder to create (new or empty)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", type=int, default=3, help="server kills")
    p.add_argument("--ranks", type=int, default=4, help="trainer rank kills")
    p.add_argument("--drivers", type=int, default=2, help="driver kills (each followed by --resume)")
    p.add_argument("--fill", type=int, default=1, choices=(0, 1), help="fill the checkpoint folder once")
    p.add_argument("--tmpfs-mb", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=900.0, help="most seconds to wait for any one step")
    p.add_argument("--python", default=None, help="interpreter of the run (default: this one)")
    p.add_argument("--endpoint", default=None, help="run on this running server (servers.endpoints); --servers 0")
    p.add_argument("--no-load-check", dest="load_check", action="store_false",
                   help="skip loading the final checkpoint into a fresh trainer (rollverify export)")
    a = p.parse_args()
    if not subreaper():
        print("warning: could not become the subreaper; processes the driver leaves may go unseen", file=sys.stderr)
    report = Chaos(a).run()
    text = json.dumps(report, indent=1, default=str)
    Path(a.out).with_name(Path(a.out).name + ".chaos.json").write_text(text + "\n")
    print(json.dumps({k: report[k] for k in ("ok", "checks", "injected", "recovered", "steps_redone",
                                              "seconds_lost", "responses_lost", "rank_detect_s", "wall_s")},
                     indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
