"""Rank-side process hygiene and the fault-injection test hook, shared by both launchers' rank processes. This
module imports only the standard library, so a rank process runs it before anything heavy.

`watch_parent` (`rank_process` starts it first): a local rank process exits when the driver that started it is
gone (a SIGKILLed driver leaves no rank behind). A thread polls the parent pid, because `PR_SET_PDEATHSIG` fires when the *thread* that forked the
child exits, not the process, and the driver may start ranks from any thread.

`arm`: the documented test hook. With `ROLLVERIFY_RANK_FAULTS` naming a JSON file, a rank SIGKILLs itself where
the file says: a list of `{"rank": r, "method": name, "call": n, "step": k, "after_s": s}` (`method`: any
attribute of the `MegatronTrainer`, public like `train_step`, `compute_logprobs`, `sync_weights` (the weight
push through the driver; the driver names its call `iter_hf_tensors`), `save_checkpoint`, or internal like `_logprobs` (the old-log-prob pass inside
`train_step`, and the verification forward) and `_loss_pass` (forward/backward); `call`: its n-th call in this
rank process, default 1; `step`: instead, its first call while the trainer has made k optimizer steps (the loop's
step k+1 trains at k, verifies and pushes at k+1; the checkpoint of step k is written at k); `after_s`: die that
long after the call starts instead of at its start, default 0). Each entry fires once per file: the rank claims it by creating
`<file>.fired-<i>` (holding the time it fired) before it dies, so a restarted rank does not fire it again.
Nothing happens without the variable.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

FAULTS_ENV = "ROLLVERIFY_RANK_FAULTS"


def watch_parent(interval_s: float = 0.5) -> None:
    """SIGKILL this process once its parent process is gone (checked every `interval_s` on a daemon thread)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rollverify-parent-watch", daemon=True).start()


def rank_process(entry: str, *args: Any) -> None:
    """A local rank process's target (megatron_bridge.spawned.PipeRanks): the parent watchdog first, before
    torch and Megatron-Core are imported (a minute on a loaded machine, during which a dead driver would
    otherwise go unnoticed), then `entry` ("module:function", the rank's loop) with `args`. The entry is named,
    not passed: unpickling a function imports its module, torch with it, before this runs."""
    import importlib

    watch_parent()
    module, name = entry.split(":")
    getattr(importlib.import_module(module), name)(*args)


def fired_path(spec: str | os.PathLike, index: int) -> Path:
    return Path(f"{spec}.fired-{index}")


def _claim(spec: str, index: int) -> bool:
    try:
        fd = os.open(fired_path(spec, index), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def _die(spec: str, index: int) -> None:
    if _claim(spec, index):
        os.kill(os.getpid(), signal.SIGKILL)


def arm(trainer: Any, rank: int) -> list[dict]:
    """Wrap the trainer methods that `ROLLVERIFY_RANK_FAULTS` names for this rank; returns the armed entries."""
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return []
    entries = json.loads(Path(spec).read_text())
    armed = []
    for i, e in enumerate(entries):
        if int(e["rank"]) != rank or fired_path(spec, i).exists():
            continue
        original = getattr(trainer, e["method"])
        step = None if e.get("step") is None else int(e["step"])
        setattr(trainer, e["method"], _wrapped(original, trainer, spec, i, int(e.get("call", 1)), step,
                                               float(e.get("after_s", 0))))
        armed.append(e)
    return armed


def _wrapped(original, trainer: Any, spec: str, index: int, nth: int, step: int | None, after_s: float):
    calls = 0

    @functools.wraps(original)
    def call(*args, **kwargs):
        nonlocal calls
        calls += 1
        if (calls == nth) if step is None else (getattr(trainer, "step_count", None) == step):
            if after_s > 0:
                threading.Timer(after_s, _die, (spec, index)).start()
            else:
                _die(spec, index)
        return original(*args, **kwargs)

    return call
