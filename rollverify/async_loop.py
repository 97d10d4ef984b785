"""The asynchronous schedule (`algo.schedule: async`): rollout never waits for training, and every token a step
trains has passed the two-stage verification against the policy that step starts from.

The placement is disaggregated: the servers generate continuously; the driver keeps them fed and drains what
they finish into the run's `Rollout`, whose buffer's completed groups are the trainer's queue. Step k (the
trainer holds version k):

1. Take. The first B finished groups leave the queue. The trainer's old-log-prob pass (the one its step
   computes anyway, `Trainer.old_logprobs`) gives their tokens' log-probs under version k, and the strategy
   checks every token against them (rollverify: the two stages; partial: nothing, the unverified asynchronous
   baseline); a response with a token more than `algo.max_staleness` versions old restarts. A group whose
   responses all pass whole is accepted. Any other goes back to the buffer cut to its verified prefixes, its
   cut responses back to the engines to regenerate their suffixes under the newest version, and the step takes
   the next finished groups, until it has B. A group that went back completes under whatever version the
   trainer holds when it has finished again, and is verified then as a whole, its siblings included: the
   guarantee admits nothing less (a token that passed against version k has not passed against k+1), and for a
   group the step trains the check costs no pass of its own (the old-log-prob pass computes those log-probs
   anyway). A sibling that fails then has drifted past the thresholds under the newer policy; cutting it is the
   verification's job. What amplified this was the switch counting rounds (one bad step of several rounds
   filled its window): it sees one acceptance per step. `n_returned_again` counts the groups that go back more
   than once.
2. Train. One optimizer step on the accepted groups with those old log-probs (version k -> k+1).
3. Publish. The engines pause, load version k+1 and resume (the weights' channel). With `algo.verify_on:
   engine` they first prefill their in-flight responses under it, and what drifted is cut before they resume,
   so that no server keeps decoding on a drifted prefix. In-flight responses past the staleness bound restart.

The trainer's calls run on a worker thread (`ThreadCalls`: the trainer's ranks are child processes or Ray
actors; the simulator: a second clock); while one runs, the driver keeps feeding the engines (`_background`),
the one thread that touches the buffer, the ledger and the engines: the engines stop only for the publish's
pause. Multi-turn tasks run here as in the alternating schedule (the `Rollout`'s tool turns): a call in flight at
a publish runs on and its output is appended after it; a verification cut inside or before a waiting call
discards its output.

Accounting: `Ledger.check` after every step, the queue and the in-flight responses being buffer groups; a
checkpoint (`state` + the buffer) holds both. Conditional fallback: each step's acceptance (kept / verified tokens
of the groups it verified, over all its rounds) feeds a `ConditionalSwitch` once; once it fires, the schedule verifies every carried response
against the current policy and hands the same `Rollout` to the alternating `Loop` (`algo.fallback`: alternating,
or on_policy, which first shelves every group but the B the next step completes), which runs the steps from then
on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from rollverify.buffer import RolloutBuffer
from rollverify.loop import Loop, StepResult
from rollverify.rollout import SYNC_PREFIX, TRAIN_PREFIX, VERIFY_PREFIX, Rollout, Schedule
from rollverify.strategies import AlgoConfig, ConditionalSwitch, VerifyOutcome, make_strategy
from rollverify.types import Group, Response

ENGINE_VERIFY_PREFIX = "engine_verify/"  # statistics of the publish's verification of in-flight responses


class Pending(Protocol):
    """A trainer call in progress."""

    def done(self) -> bool: ...

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s for it (the engines have nothing to do meanwhile)."""

    def result(self) -> Any: ...


class Calls(Protocol):
    """Where the trainer's calls run while the driver polls the engines."""

    def start(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending: ...

    def close(self) -> None: ...


class _Future:
    def __init__(self, future: futures.Future) -> None:
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout: float) -> None:
        futures.wait([self.future], timeout)

    def result(self) -> Any:
        return self.future.result()


class ThreadCalls:
    """Trainer calls on one worker thread, one at a time, in order (they block on the trainer's ranks)."""

    def __init__(self) -> None:
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="rollverify-trainer")

    def start(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending:
        return _Future(self._pool.submit(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class AsyncLoop(Schedule):
    """The asynchronous schedule over one run's `Rollout` (`calls`: where the trainer's calls run)."""

    def __init__(self, algo: AlgoConfig, rollout: Rollout, calls: Calls | None = None) -> None:
        if algo.schedule != "async":
            raise ValueError(f"AsyncLoop runs algo.schedule: async, got {algo.schedule!r}")
        self.algo, self.rollout = algo, rollout
        self.calls: Calls = calls or ThreadCalls()
        self.verifier = make_strategy(algo.mode, replace(algo, conditional_switch=False, tail_batching=False))
        self.switch = (ConditionalSwitch(algo.switch_window, algo.switch_tau, algo.switch_estimator, algo.ema_alpha)
                       if algo.mode == "rollverify" and algo.conditional_switch else None)
        # new groups launch only while fewer finished groups than this wait for the trainer
        self.queue_cap = algo.queue_groups or rollout.cfg.batch_groups
        self.fallback: Loop | None = None  # the alternating loop the switch handed the run to
        # one record shape for a run (rollverify.metrics): a run that may fall back logs the fallback's keys null
        # before it does, and the asynchronous steps' keys null after
        self._fallback_keys = (sorted(Loop(self._fallback_algo(algo.fallback), rollout).record_keys())
                               if self.switch is not None else [])
        self._async_keys: list[str] = []
        # times each group in the buffer went back since it was launched (a statistic: n_returned_again)
        self._returns: dict[int, int] = {}

    @property
    def mode(self) -> str:
        return self.fallback.mode if self.fallback is not None else self.algo.mode

    def run_step(self) -> StepResult:
        if self.fallback is not None:
            result = self.fallback.run_step()
            result.metrics = {**self._padding(), **result.metrics, "schedule": "alternating"}
            return result
        r = self.rollout
        t0 = time.perf_counter()
        trained0 = r.ledger.trained_tokens
        r.begin_step()
        r.engine.resume()  # after a restore; a running engine ignores it
        r.submit_missing()
        queued = r.buffer.num_finished
        taken = self._take()
        if taken is None:  # acceptance stayed low: this step and the rest run on the fallback
            return self._fall_back()
        groups, old, verified = taken
        t1 = time.perf_counter()
        train_metrics = r.train(groups, self.algo.adv_use_std, old, call=self._background)
        # auto thresholds start from the same-version mismatch floor
        self.verifier.observe_floor(train_metrics.get(TRAIN_PREFIX + "mismatch_ops_mean"))
        t2 = time.perf_counter()
        published = self._publish()
        t3 = time.perf_counter()
        metrics = {
            **train_metrics, **verified, **published, "switched": False,
            **({"switch_estimate": self.switch.estimate if self.switch.updates else float("nan")}
               if self.switch is not None else {}),
            **r.counts.figures(r.ledger), **r.end_step(groups),
            "mode": self.algo.mode, "schedule": "async", "queue_groups_at_start": queued,
            "trained_tokens": r.ledger.trained_tokens - trained0,
            "take_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2, "step_s": t3 - t0,
        }
        if self.switch is not None:
            metrics = {**dict.fromkeys(self._fallback_keys), "fallback": None, **metrics}
            self._async_keys = sorted(metrics)
        return StepResult(metrics, groups)

    def _padding(self) -> dict[str, None]:
        """The keys of the asynchronous steps' records, null, for a fallback step's record."""
        return {**dict.fromkeys(self._async_keys), "fallback": None, "switch_estimate": None}

    # --- feeding the engines while the trainer works -----------------------------------------------------

    def _feed(self) -> bool:
        """One round: launch groups into the room while the queue is short, poll (`Rollout.poll`). Returns
        whether the engines have anything live."""
        r = self.rollout
        if r.buffer.num_finished < self.queue_cap:
            r.fill()
        r.poll()
        live = r.live()
        if live and r.stalled():
            raise TimeoutError(f"the engines finished no response for {self.cfg.phase_timeout_s:.0f} s ({live} live)")
        return live > 0

    def _background(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the trainer's worker; the engines are fed and drained until it returns."""
        pending = self.calls.start(fn, *args, **kwargs)
        while not pending.done():
            if not self._feed() and not pending.done():
                pending.wait(self.cfg.wait_s or 0.01)
        return pending.result()

    def await_finished(self, groups: int) -> None:
        """Feed the engines until at least `groups` finished groups wait in the queue."""
        buffer = self.rollout.buffer
        self.rollout.expect_progress()
        while buffer.num_finished < groups:
            if not self._feed() and self.queue_cap <= buffer.num_finished < groups:  # nothing live or launching
                raise RuntimeError(f"{buffer.num_finished} finished groups wait, {groups} needed, and nothing "
                                   f"generates: the queue's cap ({self.queue_cap}) is below the step's groups")

    # --- 1. take: B groups, every token verified against the step's policy ------------------------------------

    def _take(self) -> tuple[list[Group], list[np.ndarray], dict[str, Any]] | None:
        """B finished groups that passed verification against the trainer's version and their old log-probs;
        groups that failed went back to the buffer and their cut responses to the engines. The step's acceptance
        over its rounds feeds the conditional switch; None when it fires (the accepted groups are back in the
        queue)."""
        r, b = self.rollout, self.cfg.batch_groups
        accepted: list[Group] = []
        old: list[np.ndarray] = []
        outcomes: list[VerifyOutcome] = []
        returned = again = 0
        while len(accepted) < b:
            self.await_finished(b - len(accepted))
            groups = r.buffer.pop_finished(b - len(accepted))
            responses = [x for g in groups for x in g.responses]
            lps = self._background(r.trainer.old_logprobs, responses, self.cfg.temperature)
            outcome = self._verify(responses, lps)
            outcomes.append(outcome)
            i = 0
            for g in groups:
                keep, n = outcome.keep_lengths[i:i + g.n], outcome.lengths[i:i + g.n]
                if np.array_equal(keep, n):
                    accepted.append(g)
                    old += lps[i:i + g.n]
                else:
                    self._return(g, dict(zip(outcome.response_ids[i:i + g.n], keep.tolist(), strict=True)))
                    returned += 1
                    again += self._returns.get(g.group_id, 0) > 0
                    self._returns[g.group_id] = self._returns.get(g.group_id, 0) + 1
                i += g.n
            # a step whose acceptance so far would fire the switch ends here (a step in which nothing passes
            # would not end otherwise); the switch sees it as this step's one acceptance
            if len(accepted) < b and self._switched(take_metrics(outcomes), peek=True):
                break
        verified = take_metrics(outcomes)
        if self._switched(verified):
            for g in accepted:
                r.buffer.add_group(g)
            return None
        for g in accepted:
            self._returns.pop(g.group_id, None)
        staleness = [x.staleness(self.version) for g in accepted for x in g.responses]
        return accepted, old, {
            **verified, "n_returned_groups": returned, "n_returned_again": again, "verify_rounds": len(outcomes),
            "trained_staleness_max": max(staleness), "trained_staleness_mean": float(np.mean(staleness)),
        }

    def _verify(self, responses: list[Response], lps: list[np.ndarray]) -> VerifyOutcome:
        """The strategy's keep lengths against the step's policy, a response past the staleness bound restarting."""
        outcome = self.verifier.apply(responses, lps, self.version)
        stale = np.array([r.staleness(self.version) > self.algo.max_staleness for r in responses], bool)
        keep = outcome.keep_lengths = np.where(stale, 0, outcome.keep_lengths)
        nonempty = outcome.lengths > 0
        kept = sum(int(np.count_nonzero(r.policy_mask[:k])) for r, k in zip(responses, keep.tolist(), strict=True))
        outcome.stats.update(restarted_stale=float(stale.sum()), kept_tokens=float(kept),  # policy tokens, as verified
                             restarted=float(np.sum(nonempty & (keep == 0))),
                             truncated=float(np.sum((keep > 0) & (keep < outcome.lengths))))
        return outcome

    def _return(self, group: Group, keep: dict[str, int]) -> None:
        """A group that failed verification back into the buffer, cut; its cut responses regenerate their
        suffixes (a server revives a finished response it holds when it is cut; one it lost is resubmitted)."""
        r = self.rollout
        r.resubmit_lost()  # the group's own lost responses are out of the buffer: finished, nothing to resubmit
        r.buffer.add_group(group)
        r.cut(keep)
        r.send()
        r.submit_missing({group.group_id})

    # --- 3. publish -------------------------------------------------------------------------------------------

    def _publish(self) -> dict[str, Any]:
        """Pause, push, (engine mode: verify the in-flight responses under the new weights), restart what went
        past the staleness bound, resume."""
        r = self.rollout
        r.pause()
        out: dict[str, Any] = {"n_in_flight": sum(1 for x in r.buffer.pending() if x.num_tokens)}
        t0 = time.perf_counter()
        pushed = r.weights.push(self.version)
        out["sync_s"] = time.perf_counter() - t0
        if self.algo.verify_on == "engine":
            t1 = time.perf_counter()
            out.update(self._verify_in_flight())
            out["engine_verify_s"] = time.perf_counter() - t1
        out["n_restarted_stale"] = self._bound_staleness()
        r.resume()
        return {**out, **{SYNC_PREFIX + k: v for k, v in pushed.items()}}

    def _verify_in_flight(self) -> dict[str, Any]:
        """The engines prefill their paused responses under the new weights (their resume needs it anyway) and
        return the log-probs; the verified prefixes resume, so no server decodes on a drifted prefix."""
        r = self.rollout
        tracked = r.engine.response_ids()
        carried = [x for x in r.buffer.pending() if x.num_tokens and x.response_id in tracked]
        lps, on_engine = r.new_logprobs(carried, on_engine=True)
        outcome = self.verifier.apply(carried, lps, self.version)
        cut = r.cut(outcome.decisions)
        r.send()
        return {**{ENGINE_VERIFY_PREFIX + k: v for k, v in outcome.stats.items()},
                ENGINE_VERIFY_PREFIX + "cut_tokens": float(cut.policy), ENGINE_VERIFY_PREFIX + "on_engine": float(on_engine)}

    def _bound_staleness(self) -> int:
        """Every buffer response holding a token more than `max_staleness` versions behind restarts (its oldest
        tokens are its first: nothing of it would pass the bound). Returns how many."""
        r = self.rollout
        stale = {x.response_id: 0 for x in r.buffer.carried_over()
                 if x.staleness(self.version) > self.algo.max_staleness}
        if stale:
            r.cut(stale)
            r.send()
        return len(stale)

    # --- conditional fallback ---------------------------------------------------------------------------------

    def _switched(self, verified: dict[str, Any], peek: bool = False) -> bool:
        """The step's acceptance (kept / verified policy tokens over all its rounds) into the switch, once a
        step, so that its window counts steps as the alternating loop's does whatever rounds a step took; True
        when it fires (`peek`: would fire, the switch left as it is)."""
        if self.switch is None or not verified["verified_tokens"]:
            return False
        rate = verified["kept_tokens"] / verified["verified_tokens"]
        return self.switch.would_switch(rate) if peek else self.switch.update(rate)

    def _fall_back(self) -> StepResult:
        """The switch fired while a step took its groups: the engines pause, every carried response (the queue's
        and the in-flight ones) is verified against the current policy with the trainer's log-probs and cut to
        its verified prefix, so that the alternating loop starts from the state its own verification would have
        left (on_policy: with every group but the B the next step completes shelved, as its own switch does);
        the fallback loop then runs this step over the same `Rollout`."""
        r = self.rollout
        r.pause()
        r.resubmit_lost()
        carried = r.buffer.carried_over()
        if carried:
            lps = r.trainer.compute_logprobs(carried, self.cfg.temperature)
            r.cut(self.verifier.apply(carried, lps, self.version).decisions)
            r.send()
        if self.algo.fallback == "on_policy":
            r.shelve()
            r.send()
        r.ledger.check(r.buffer)
        self.fallback = Loop(self._fallback_algo(self.algo.fallback), r)
        mode = self.fallback.mode
        result = self.fallback.run_step()
        assert self.switch is not None
        result.metrics = {**self._padding(), **result.metrics, "schedule": "alternating", "switched": True,
                          "switch_reason": self.switch.reason, "switch_estimate": self.switch.estimate,
                          "fallback": mode}
        return result

    def _fallback_algo(self, mode: str) -> AlgoConfig:
        """The fallback loop's settings: `mode` alternating keeps `algo.mode` (a rollverify run gets a fresh
        conditional switch), on_policy runs on_policy."""
        return replace(self.algo, schedule="alternating", mode="on_policy" if mode == "on_policy" else self.algo.mode)

    # --- checkpoints ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able state (the buffer, with the queue and the in-flight responses, and the trainer are saved
        beside it). The engines' output since the last publish is not in it: a restored run regenerates it."""
        if self.fallback is not None:
            return {**self.fallback.state(), "schedule": "alternating", "fallback_mode": self.fallback.mode,
                    "async_keys": self._async_keys}
        return {"schedule": "async", **self.rollout.state(),
                "switch": self.switch.to_state() if self.switch is not None else None}

    def restore(self, state: dict[str, Any], buffer: RolloutBuffer) -> None:
        if state.get("schedule") == "alternating":  # the run had fallen back
            self.fallback = Loop(self._fallback_algo(state["fallback_mode"]), self.rollout)
            self.fallback.restore(state, buffer)
            self._async_keys = list(state.get("async_keys", []))
            return
        self.rollout.restore(state, buffer)
        if self.switch is not None and state.get("switch"):
            self.switch = ConditionalSwitch.from_state(state["switch"])

    def close(self) -> None:
        """The engines stop generating and forget the run's responses (servers given by `servers.endpoints`
        outlive the run; a resumed run resubmits from its checkpoint's buffer), and the worker thread ends."""
        try:
            if self.fallback is None:
                engine = self.rollout.engine
                if not engine.paused:
                    engine.pause()
                if held := engine.response_ids():
                    engine.drop(sorted(held))
        finally:
            self.calls.close()


def take_metrics(outcomes: list[VerifyOutcome]) -> dict[str, Any]:
    """One step's verification over its rounds: token and response sums, whole under `verify/`, the headline
    figures under their own names (the alternating loop's)."""
    s: dict[str, float] = {}
    for o in outcomes:
        for k in ("responses", "verified_tokens", "kept_tokens", "restarted", "truncated", "restarted_stale"):
            s[k] = s.get(k, 0.0) + float(o.stats.get(k, 0.0))
    whole = np.concatenate([o.keep_lengths == o.lengths for o in outcomes])
    ops = [(o.stats["verified_tokens"], o.stats["ops_mean"]) for o in outcomes
           if np.isfinite(o.stats.get("ops_mean", np.nan))]
    s["acceptance_rate"] = s["kept_tokens"] / s["verified_tokens"] if s["verified_tokens"] else float("nan")
    s["kept_whole_rate"] = float(whole.mean()) if whole.size else float("nan")
    s["ops_mean"] = sum(n * v for n, v in ops) / sum(n for n, _ in ops) if ops else float("nan")
    return {**{VERIFY_PREFIX + k: v for k, v in s.items()},
            **{k: s[k] for k in ("acceptance_rate", "kept_whole_rate", "verified_tokens", "kept_tokens", "ops_mean")}}
