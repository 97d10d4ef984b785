"""The run's supervision: what `rollverify train` does when something dies under it (its steps are
`rollverify.app.train.run_steps`, each one inside `Supervisor.recovering`).

* A trainer rank that dies, stalls past `trainer.call_timeout_s` or raises (in any call: the old-log-prob pass
  and the step in `train_step`, the verification forward, the weight push, the checkpoint) reaches the driver as
  `megatron_bridge.proxy.RankFailure` within that bound (a death: at once). The supervisor kills the other ranks,
  starts new ones from the last checkpoint (none yet: the initial weights at step 0), makes the engines forget
  every response they hold and serve the restored policy, and restores the loop with the checkpoint's buffer, so
  its carried-over responses replace those of the lost steps. The steps after the checkpoint are redone; the
  metrics writer drops their first records, so each step is logged once. At most `recovery.max_restarts`
  restarts per driver process; the next fault stops the run with a message naming the rank, the phase and the
  command that resumes it.
* A checkpoint that cannot be written (`rollverify.app.checkpoints.CheckpointError`) leaves the previous one
  current; the run says so and goes on (`recovery.checkpoint_errors: continue`) or stops (`stop`).
* A lost SGLang server is the rollout engine's own business (restarted, its responses resubmitted); a killed
  driver is resumed by `rollverify train --resume DIR`, its rank and server processes having exited with it.

Every fault and what it cost goes to DIR/faults.jsonl (one line each) and the summary's `faults`. A step's
metrics carry the books that let a whole run be audited across restarts: `trained_groups` (the group ids it
trained) and the ledger under `ledger/`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollverify.app.checkpoints import CheckpointError
from rollverify.app.console import say
from rollverify.sections import bounded

FAULTS = "faults.jsonl"
LEDGER_PREFIX = "ledger/"  # the run's ledger after each step, whole
log = logging.getLogger(__name__)


@dataclass
class RecoveryConfig:
    """The `recovery` section: what the run does when a trainer rank dies or a checkpoint cannot be written.
    (The time-outs that bound how long a dead rank can go unnoticed are the trainer's: `trainer.call_timeout_s`
    for a call, `trainer.dist_timeout_s` for a collective; the servers': `servers.timeout_s`.)"""

    max_restarts: int = bounded(3, ge=0)  # trainer restarts from the last checkpoint per driver process
    checkpoint_errors: Literal["continue", "stop"] = "continue"  # a checkpoint that cannot be written


class RunStopped(RuntimeError):
    """The run cannot go on by itself; the message says why and how to resume it."""


def resume_command(out: Path, config_file: Path | None = None) -> str:
    cfg = config_file or out / "config.json"
    return f"rollverify train --config {shlex.quote(str(cfg))} --resume {shlex.quote(str(out))}"


def forget_responses(engine: Any) -> int:
    """The engines drop every response they hold (the buffer they came from is being replaced): pause them,
    take what they reported up to the pause, drop. Nothing of those responses arrives afterwards."""
    engine.pause()
    engine.wait_finished(0.0)
    held = sorted(engine.response_ids())
    if held:
        engine.drop(held)
    engine.wait_finished(0.0)
    return len(held)


class Supervisor:
    """Recovery from trainer faults and failed checkpoints for `run` and its metrics writer, as the module
    docstring says."""

    def __init__(self, run: Any, writer: Any, resume_cmd: str) -> None:
        self.run, self.writer = run, writer
        self.cfg = run.cfg.recovery
        self.resume_cmd = resume_cmd
        self.restarts = 0
        self.faults: list[dict[str, Any]] = []
        self.faults_file = Path(run.out) / FAULTS
        self._servers_seen = 0  # the engine's server fault records already written

    @contextlib.contextmanager
    def recovering(self) -> Iterator[None]:
        """A step: a trainer fault anywhere in it restarts the trainer from the last checkpoint (the loop goes on
        from there, the steps after it redone) or stops the run; the servers the engine lost meanwhile are
        logged either way."""
        from megatron_bridge.proxy import RankFailure

        try:
            yield
        except RankFailure as e:
            self._restart(e)
        finally:
            self._server_faults()

    def checkpoint(self) -> None:
        """A checkpoint of the current step; one that cannot be written is logged and the run goes on or stops
        (`recovery.checkpoint_errors`)."""
        t0 = time.perf_counter()
        try:
            self.run.save()
        except CheckpointError as e:
            self._record({"kind": "checkpoint", "step": e.step, "kept_step": e.kept, "reason": e.reason,
                          "lost_s": time.perf_counter() - t0, "action": self.cfg.checkpoint_errors})
            if self.cfg.checkpoint_errors == "stop":
                raise RunStopped(f"{e}. The run stops (recovery.checkpoint_errors: stop); free the space or fix "
                                 f"the permissions, then resume it: {self.resume_cmd}") from e
            say(f"warning: {e}; the run goes on (recovery.checkpoint_errors: continue)")

    def _restart(self, e: Any) -> None:
        """Trainer fault `e` (RankFailure): new ranks from the last checkpoint, or stop past max_restarts. A
        rank that fails while the new ranks start or load counts as the next fault."""
        from megatron_bridge.proxy import RankFailure

        done = self.run.loop.step  # steps completed when it failed
        while True:
            t0 = time.perf_counter()
            record = {"kind": "trainer", "rank": e.rank, "how": e.kind, "method": e.method, "phase": e.phase,
                      "completed_steps": done, "detected_at": time.time()}
            where = f"in the {e.phase} ({e.method}) after step {done}"
            if e.kind == "error":
                log.warning("trainer fault: %s", e)  # a rank's own traceback
            if self.restarts >= self.cfg.max_restarts:
                self._record({**record, "action": "stop"})
                self.run.close_trainer()
                how = (f"resume the run from its last checkpoint with: {self.resume_cmd}"
                       if self.run.checkpoints.current() is not None else
                       "it has no checkpoint to resume from (log.checkpoint_every: 0, or none written yet): start "
                       "it again")
                raise RunStopped(f"trainer rank {e.rank} {_how(e.kind)} {where}, after {self.restarts} "
                                 f"restart(s) (recovery.max_restarts: {self.cfg.max_restarts}); {how}") from e
            self.restarts += 1
            say(f"warning: trainer rank {e.rank} {_how(e.kind)} {where}; restarting the trainer from the last "
                f"checkpoint (restart {self.restarts} of {self.cfg.max_restarts})")
            try:
                restored = self.run.restart_trainer()
            except RankFailure as again:
                self._record({**record, "action": "restart", "restart_failed": str(again).splitlines()[0],
                              "restart_failed_detail": again.detail[-1000:]})
                e = again
                continue
            self.writer.rewind(restored)
            self._record({**record, "action": "restart", "restored_step": restored, "steps_redone": done - restored,
                          "recover_s": time.perf_counter() - t0})
            return

    def _server_faults(self) -> None:
        """The servers the engine lost since the last look (it restarted them and its loop resubmitted their
        responses), into the fault log."""
        server = getattr(self.run.engine, "faults", [])
        for f in server[self._servers_seen:]:
            self._record({"kind": "server", "server": f["server"], "restarted": f["restarted"],
                          "responses_resubmitted": len(f["lost"]), "step": self.run.loop.step + 1})
        self._servers_seen = len(server)

    def _record(self, fault: dict[str, Any]) -> None:
        fault = {"n": len(self.faults) + 1, "time": time.time(), **fault}
        self.faults.append(fault)
        with self.faults_file.open("a") as f:
            f.write(json.dumps(fault) + "\n")

    def summary(self) -> dict[str, Any]:
        """The faults this driver process met, by kind, for summary.json (the server faults are the engine's)."""
        return {"trainer_restarts": self.restarts,
                "checkpoint_failures": sum(f["kind"] == "checkpoint" for f in self.faults),
                "server_faults": sum(f["kind"] == "server" for f in self.faults),
                "steps_redone": sum(f.get("steps_redone", 0) for f in self.faults)}


def _how(kind: str) -> str:
    return {"died": "died", "silent": "stopped answering", "error": "failed"}.get(kind, kind)
