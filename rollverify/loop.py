"""The alternating schedule, as DESIGN.md tells it: rollout -> train -> verify -> resync.

For step k under policy version k:

1. Rollout: carried-over responses resume first (the engine kept them paused), unfinished ones it no longer
   holds are resubmitted from prompt + kept prefix, and new GRPO groups launch while capacity frees up. In the
   carry-over modes the phase ends as soon as B groups have finished and every live response is paused, its
   partial output recorded. In `on_policy` the phase completes exactly B groups: the buffer's first B (a
   backlog left by a switch; finished ones first, then oldest first), new ones for the rest; backlog groups
   beyond B wait off the engines, holding no tokens, for a later step.
   With `algo.tail_batching` (on-policy tail batching, for on_policy and for what the switch falls to) a
   regular round launches `tail_launch` x B new groups and ends once B of them have finished: the engines
   pause and every other group goes back to its prompt, its partial responses dropped (`Rollout.defer`), to
   wait off the engines; once B groups wait, the step is a long round that generates exactly the B oldest of
   them to completion. Every token a step trains is then sampled by the policy the step starts from.
2. Train: the first B finished groups make one optimizer step (version k -> k+1).
3. Verify: every response still in the buffer (all went stale) is checked against version k+1 by the
   strategy of the mode and cut to its verified prefix, in the buffer and on the engine; the strategy's
   statistics are logged whole under ``verify/``, a few of them also under their own names. The verification
   that switches to on_policy keeps the verified prefixes of the B groups the next step completes and sends
   every other group back to its prompt, off the engines (`Rollout.shelve`): the switch wastes at most the
   backlog of that one step, and every later step generates only what it trains.
4. Resync: the new weights reach the engines, after the truncation decisions. With `algo.verify_on: engine`
   they reach them before step 3 instead, and the engines compute the new log-probs of the carried tokens
   (prefilling what resuming needs anyway) while they already generate the next step's new groups, the carried
   responses held until they are verified and cut; the trainer then runs no verification forward.

What each phase does to a response (launch, record, score, tool turns, cut, shelve, train, account) is the
`rollverify.rollout.Rollout`'s, which the asynchronous schedule drives too; this module is the phase logic.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from rollverify.buffer import RolloutBuffer, TokenCounts
from rollverify.rollout import SYNC_PREFIX, TRAIN_PREFIX, VERIFY_PREFIX, Rollout, Schedule
from rollverify.strategies import AlgoConfig, Strategy, VerifyOutcome, make_strategy
from rollverify.types import Group, Response

# a tail-batched run's step record: whether the step was a long round, the groups it sent back to wait and their
# dropped tokens, and the groups waiting for a long round after it
TAIL_KEYS = ("tail/long_round", "tail/deferred_groups", "tail/dropped_tokens", "tail/waiting_groups")


@dataclass
class StepResult:
    metrics: dict[str, Any]
    trained_groups: list[Group] = field(default_factory=list)


class Loop(Schedule):
    """The alternating schedule over one run's `Rollout`."""

    def __init__(self, algo: AlgoConfig, rollout: Rollout) -> None:
        self.algo, self.rollout = algo, rollout
        self.strategy: Strategy = make_strategy(algo.mode, algo)

    @property
    def mode(self) -> str:
        return self.strategy.mode

    def run_step(self) -> StepResult:
        r = self.rollout
        t0 = time.perf_counter()
        mode = self.mode
        rolled = self.rollout_phase()
        t1 = time.perf_counter()
        groups = r.buffer.pop_finished(self.cfg.batch_groups)
        r.weights.before_training()
        train_metrics = r.train(groups, self.algo.adv_use_std)
        # auto thresholds start from the same-version mismatch floor
        self.strategy.observe_floor(train_metrics.get(TRAIN_PREFIX + "mismatch_ops_mean"))
        t2 = time.perf_counter()
        verified, verify_s, sync_s = self._verify_and_sync()
        t4 = time.perf_counter()
        metrics = {
            **train_metrics,
            **rolled,
            **verified,
            **r.end_step(groups),
            "mode": mode,
            "rollout_s": t1 - t0,
            "train_s": t2 - t1,
            "verify_s": verify_s,
            "sync_s": sync_s,
            "step_s": t4 - t0,
        }
        return StepResult(metrics, groups)

    # --- 1. rollout -----------------------------------------------------------------------------------------

    def rollout_phase(self) -> dict[str, Any]:
        """Step 1; returns the phase's figures (`StepCounts`) and how many responses the pause stopped."""
        r, b = self.rollout, self.cfg.batch_groups
        r.begin_step()
        r.resume()
        # on_policy completes exactly B groups, the backlog's first; the carry-over modes keep the engines full;
        # a tail-batched regular round launches more and ends at the first B (`quota`, `need`)
        phase = None if self.strategy.carries_over else r.first_groups()
        quota = need = b
        regular = self.algo.tail_batching and phase is not None and len(phase) < b
        if regular:
            phase, quota = [], math.ceil(self.algo.tail_launch * b)  # the waiting groups wait for a long round
        # after a restore, a lost server or a switch the engine no longer holds some unfinished responses
        r.resubmit_lost(phase)
        r.submit_missing(phase)
        r.expect_progress()
        while True:
            launched = r.fill(None if phase is None else quota - len(phase))
            if phase is not None:
                phase += launched
            r.poll(phase)
            if phase is None and r.buffer.num_finished >= b:
                break
            if phase is not None and sum(r.buffer.groups[g].finished for g in phase) >= need \
                    and (regular or len(phase) == quota):
                break  # on_policy: the phase's B groups have finished; tail-batched: B of them
            if r.stalled():
                raise TimeoutError(f"rollout made no progress for {self.cfg.phase_timeout_s:.0f} s "
                                   f"({r.live()} responses live on the engines)")
        tail = dict.fromkeys(TAIL_KEYS, 0) if self.algo.tail_batching else {}
        if self.strategy.carries_over:
            paused = r.pause()
        elif regular:
            paused = r.live()
            deferred, dropped = r.defer()
            tail.update({"tail/deferred_groups": deferred, "tail/dropped_tokens": dropped.policy})
        else:
            paused = 0
            r.record(r.engine.wait_finished(0.0))  # anything that finished meanwhile
            if tail:
                tail["tail/long_round"] = 1
        if tail and not self.strategy.carries_over:
            tail["tail/waiting_groups"] = sum(1 for g in r.buffer.groups.values() if not g.finished)
        return {**r.counts.figures(r.ledger), "n_paused": paused, **tail}

    # --- 3. verify ------------------------------------------------------------------------------------------

    def _verify_and_sync(self) -> tuple[dict[str, Any], float, float]:
        """Steps 3 and 4 in the order of `algo.verify_on`; returns (verification metrics, verify_s, sync_s).

        trainer: verify (the trainer computes the new log-probs), then the new weights reach the engines.
        engine: the new weights reach the engines first; they prefill the carried responses under them, which
        resuming needs anyway, and return the log-probs; the cut prefixes then resume from their cached KV. The
        wait for those log-probs is the resume's prefill, while the engines also generate the next step's new
        groups (`_hold_and_fill`): it is logged as `logprob_wait_s`, outside verify_s."""
        weights = self.rollout.weights
        engine_side = self.algo.verify_on == "engine"
        pushed: dict[str, float] = {}
        t0 = time.perf_counter()
        if engine_side:
            pushed = weights.push(self.version)
        t1 = time.perf_counter()
        metrics = self.verify()
        t2 = time.perf_counter()
        if not engine_side:
            pushed = weights.push(self.version)
        t3 = time.perf_counter()
        metrics.update({SYNC_PREFIX + k: v for k, v in pushed.items()})
        return metrics, t2 - t1 - metrics.get("logprob_wait_s", 0.0), (t1 - t0) + (t3 - t2)

    def verify(self) -> dict[str, Any]:
        """Verify and cut the carried-over responses; returns the step's verification metrics. Three jobs in
        order: decide (the new log-probs and the strategy's keep lengths), apply (the cuts to the buffer and the
        ledger, and at a switch the backlog's shelving), send (the cuts and releases to the engine)."""
        r = self.rollout
        carried = r.buffer.carried_over()
        stats: dict[str, Any] = {"n_carried": len(carried)}
        if not carried:
            return self._verify_nothing(stats)
        outcome, unverified = self._decide(carried, stats)
        cut = r.cut(outcome.decisions)
        shelved_cut = r.shelve()[1] if outcome.switched else TokenCounts()
        cut += shelved_cut
        # after a pause in on_policy, so that nothing relaunches before the weights move
        r.send(relaunch=unverified is not None)
        if unverified:
            tracked = r.engine.response_ids()
            r.engine.release([rid for rid in unverified if rid in tracked])
        return {**stats, **verify_metrics(outcome, cut, shelved_cut)}

    def _verify_nothing(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The strategy's statistics of nothing: the same keys as any step's, counts 0, rates NaN."""
        wants_lp = self.strategy.needs_new_logprobs or self.algo.monitor_ops
        if wants_lp:
            stats["n_logprobs_on_engine"] = 0
        if wants_lp and self.algo.verify_on == "engine":
            stats.update(logprob_wait_s=0.0, n_launched_while_verifying=0)
        outcome = self.strategy.apply([], [] if wants_lp else None, self.version)
        return {**stats, **verify_metrics(outcome, TokenCounts(), TokenCounts())}

    def record_keys(self) -> set[str]:
        """The keys of this schedule's step record but the trainer's and the push's (train/*, sync/*,
        trained_ops_mean: the same under either schedule): what a run that falls back into it logs, null, before
        it does (rollverify.metrics' rule: one record shape for a run)."""
        r = self.rollout
        return {*r.counts.figures(r.ledger), "n_paused", *self._verify_nothing({"n_carried": 0}), *r.record_keys(),
                *(TAIL_KEYS if self.algo.tail_batching else ()),
                "mode", "rollout_s", "train_s", "verify_s", "sync_s", "step_s"}

    def _decide(self, carried: list[Response], stats: dict[str, Any]) -> tuple[VerifyOutcome, list[str] | None]:
        """The strategy's outcome over the carried responses, from their new log-probs where it needs them (or
        `algo.monitor_ops` asks for them), and the ids the engines hold back until they are cut (engine mode).
        Adds to `stats` where the log-probs came from and how long the engines took."""
        r = self.rollout
        new_lp = None
        unverified: list[str] | None = None  # engine mode: the carried responses held while the engines run
        if self.strategy.needs_new_logprobs or self.algo.monitor_ops:
            engine_side = self.algo.verify_on == "engine"
            t0 = time.perf_counter()
            if engine_side:
                stats["n_launched_while_verifying"] = 0
            if engine_side and r.engine.paused and self.strategy.carries_over:
                unverified, stats["n_launched_while_verifying"] = self._hold_and_fill(carried)
            new_lp, on_engine = r.new_logprobs(carried, on_engine=engine_side)
            stats["n_logprobs_on_engine"] = on_engine
            if engine_side:
                stats["logprob_wait_s"] = time.perf_counter() - t0
        return self.strategy.apply(carried, new_lp, self.version), unverified

    def _hold_and_fill(self, carried: list[Response]) -> tuple[list[str], int]:
        """With `verify_on: engine` after a carry-over phase (the engines paused, the new weights theirs): the
        engines resume with the unfinished carried responses held (paused until verified and cut, then
        `release`d) and the next step's new groups launch into the room, so that the engines generate them while
        they prefill the carried ones. Returns (the held ids, groups launched). A finished carried response the
        verification cuts becomes live again: until the next finish the engines may then hold up to that many
        more than `max_live` (SGLang queues what its `max_running_requests` does not take)."""
        r = self.rollout
        tracked = r.engine.response_ids()
        waiting = r.tools.waiting if r.tools is not None else (lambda _: False)
        unverified = [x.response_id for x in carried if x.response_id in tracked and not x.finished
                      and not waiting(x.response_id)]
        r.engine.resume(hold=unverified)
        return unverified, len(r.fill())

    # --- checkpoints ----------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able loop state (the buffer and the trainer are saved beside it)."""
        return {**self.rollout.state(), "strategy": self.strategy.to_state()}

    def restore(self, state: dict[str, Any], buffer: RolloutBuffer) -> None:
        self.rollout.restore(state, buffer)
        self.strategy.load_state(state["strategy"])


def verify_metrics(outcome: VerifyOutcome, cut: TokenCounts, backlog_cut: TokenCounts) -> dict[str, Any]:
    """A verification's metrics: the strategy's statistics whole under `verify/`, a few under their own names."""
    s = outcome.stats
    return {
        **{f"{VERIFY_PREFIX}{k}": v for k, v in s.items()},
        "ops_mean": s.get("ops_mean", float("nan")),  # NaN when no OPS was computed (partial, unmonitored)
        "acceptance_rate": s["acceptance_rate"],
        "kept_whole_rate": s["kept_whole_rate"],
        "staleness_max": s["staleness_max"],
        "verified_tokens": s["verified_tokens"],
        "kept_tokens": s["kept_tokens"],
        "cut_tokens": float(cut.policy),
        "backlog_cut_tokens": float(backlog_cut.policy),
        "cut_env_tokens": float(cut.env),
        "switched": bool(outcome.switched),
        "switch_reason": outcome.switch_reason,  # null but at the switch
    }
