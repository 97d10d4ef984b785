"""The asynchronous schedule (`algo.schedule: async`): rollout never waits for training, and every token a step
trains has passed the two-stage verification against the policy that step starts from.

The placement is disaggregated: the servers generate continuously; the driver keeps them fed and drains what
they finish into the `RolloutBuffer`, whose completed groups are the trainer's queue (`rollverify.async_feed`).
Step k (the trainer holds version k):

1. Take. The first B finished groups leave the queue. The trainer's old-log-prob pass (the one its step
   computes anyway, `Trainer.old_logprobs`) gives their tokens' log-probs under version k, and the strategy
   checks every token against them (rollverify: the two stages; partial: nothing, the unverified asynchronous
   baseline); a response with a token more than `algo.max_staleness` versions old restarts. A group whose
   responses all pass whole is accepted. Any other goes back to the buffer cut to its verified prefixes, its
   cut responses back to the engines to regenerate their suffixes under the newest version, and the step takes
   the next finished groups, until it has B.
2. Train. One optimizer step on the accepted groups with those old log-probs (version k -> k+1).
3. Publish. The engines pause, load version k+1 and resume (the weights' channel). With `algo.verify_on:
   engine` they first prefill their in-flight responses under it, and what drifted is cut before they resume,
   so that no server keeps decoding on a drifted prefix. In-flight responses past the staleness bound restart.

The trainer's calls run on a worker thread (`ThreadCalls`); while one runs the driver keeps feeding the engines
(`Feeder.await_call`): the engines stop only for the publish's pause.

Accounting: `Ledger.check` after every step, the queue and the in-flight responses being buffer groups; a
checkpoint (`state` + the buffer) holds both. Conditional fallback: each step's acceptance (kept / verified tokens
of the groups it verified) feeds a `ConditionalSwitch`; once it fires, the schedule verifies every carried response
against the current policy, hands its state to the alternating `Loop` (`algo.fallback`: alternating, or
on_policy) and runs its steps from then on (`rollverify.async_fallback`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import torch

from rollverify.async_fallback import handover
from rollverify.async_feed import Calls, Feeder, ThreadCalls
from rollverify.buffer import RolloutBuffer
from rollverify.interfaces import RolloutEngine, SamplingParams, Trainer, WeightSync
from rollverify.loop import (
    SYNC_PREFIX,
    TRAIN_PREFIX,
    VERIFY_PREFIX,
    InMemoryWeights,
    Ledger,
    Loop,
    RolloutConfig,
    StepResult,
    new_logprobs,
)
from rollverify.losses import grpo_advantages
from rollverify.strategies import AlgoConfig, ConditionalSwitch, VerifyOutcome, make_strategy
from rollverify.types import Group, Response

ENGINE_VERIFY_PREFIX = "engine_verify/"  # statistics of the publish's verification of in-flight responses


class AsyncLoop:
    """One asynchronous training run's state and its step function (the same surface as `Loop`)."""

    def __init__(self, cfg: RolloutConfig, algo: AlgoConfig, engine: RolloutEngine, trainer: Trainer,
                 make_group, reward, weights: WeightSync | None = None, calls: Calls | None = None) -> None:
        if algo.schedule != "async":
            raise ValueError(f"AsyncLoop runs algo.schedule: async, got {algo.schedule!r}")
        self.cfg, self.algo = cfg, algo
        self.engine, self.trainer = engine, trainer
        self.weights: WeightSync = weights or InMemoryWeights(engine, trainer)
        self.make_group, self.reward = make_group, reward
        self.calls: Calls = calls or ThreadCalls()
        self.verifier = make_strategy(algo.mode, replace(algo, conditional_switch=False))
        self.switch = (ConditionalSwitch(algo.switch_window, algo.switch_tau, algo.switch_estimator, algo.ema_alpha)
                       if algo.mode == "rollverify" and algo.conditional_switch else None)
        self.feed = Feeder(engine, make_group, reward, SamplingParams(temperature=cfg.temperature), n=cfg.n,
                           max_live=cfg.max_live, queue_cap=algo.queue_groups or cfg.batch_groups,
                           wait_s=cfg.wait_s, timeout_s=cfg.phase_timeout_s)
        self.ledger = Ledger()
        self.feed.attach(RolloutBuffer(), self.ledger)
        self.step = 0
        self.version = 0
        self.fallback: Loop | None = None  # the alternating loop the switch handed the run to

    # --- the surface train.py uses ----------------------------------------------------------------------------

    @property
    def buffer(self) -> RolloutBuffer:
        return self.fallback.buffer if self.fallback is not None else self.feed.buffer

    @property
    def next_group_id(self) -> int:
        return self.fallback.next_group_id if self.fallback is not None else self.feed.next_group_id

    @property
    def mode(self) -> str:
        return self.fallback.mode if self.fallback is not None else self.algo.mode

    def run_step(self) -> StepResult:
        if self.fallback is not None:
            result = self.fallback.run_step()
            self.step, self.version, self.ledger = self.fallback.step, self.fallback.version, self.fallback.ledger
            result.metrics["schedule"] = "alternating"
            return result
        t0 = time.perf_counter()
        feed, generated0, trained0 = self.feed, self.ledger.generated_tokens, self.ledger.trained_tokens
        feed.reset_counts()
        self.engine.resume()  # after a restore or a fallback's pause; a running engine ignores it
        feed.submit_missing()
        queued = feed.buffer.num_finished
        taken = self._take()
        if taken is None:  # acceptance stayed low: this step and the rest run on the fallback
            return self._fall_back()
        groups, old, verified = taken
        t1 = time.perf_counter()
        train_metrics = self._train(groups, old)
        t2 = time.perf_counter()
        published = self._publish()
        t3 = time.perf_counter()
        self.ledger.check(self.buffer)
        self.step += 1
        rewards = np.concatenate([g.rewards for g in groups])
        lengths = [r.num_tokens for g in groups for r in g.responses]
        metrics = {
            **train_metrics, **verified, **published, "switched": False,
            **({"switch_estimate": self.switch.estimate} if self.switch is not None and self.switch.updates else {}),
            "step": self.step, "mode": self.algo.mode, "schedule": "async", "policy_version": self.version,
            "reward_mean": float(rewards.mean()), "response_length_mean": float(np.mean(lengths)),
            "n_finished_groups": len(groups), "queue_groups_at_start": queued,
            "tokens_generated": self.ledger.generated_tokens - generated0,
            "trained_tokens": self.ledger.trained_tokens - trained0,
            "decode_iters": feed.longest_chunk, "n_launched_groups": feed.launched_groups,
            "n_resubmitted": feed.resubmitted,
            "take_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2, "step_s": t3 - t0,
        }
        return StepResult(metrics, groups)

    def _fall_back(self) -> StepResult:
        """The switch fired while a step took its groups: hand the run to the fallback loop, which runs this step."""
        self.fallback = handover(self)
        mode = self.fallback.mode
        result = self.fallback.run_step()
        self.step, self.version, self.ledger = self.fallback.step, self.fallback.version, self.fallback.ledger
        assert self.switch is not None
        result.metrics.update(schedule="alternating", switched=True, switch_reason=self.switch.reason,
                              switch_estimate=self.switch.estimate, fallback=mode)
        return result

    # --- 1. take: B groups, every token verified against the step's policy ------------------------------------

    def _take(self) -> tuple[list[Group], list[np.ndarray], dict[str, Any]] | None:
        """B finished groups that passed verification against version `self.version` and their old log-probs;
        groups that failed went back to the buffer and their cut responses to the engines. Each round's
        acceptance feeds the conditional switch; None when it fires (the round's accepted groups are back in the
        queue)."""
        b = self.cfg.batch_groups
        accepted: list[Group] = []
        old: list[np.ndarray] = []
        outcomes: list[VerifyOutcome] = []
        returned = 0
        while len(accepted) < b:
            self.feed.await_finished(b - len(accepted))
            groups = self.buffer.pop_finished(b - len(accepted))
            responses = [r for g in groups for r in g.responses]
            lps = self.feed.await_call(self.calls.start(self.trainer.old_logprobs, responses, self.cfg.temperature))
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
                i += g.n
            if self._switched(outcome):
                for g in accepted:
                    self.buffer.add_group(g)
                return None
        trained = [r for g in accepted for r in g.responses]
        staleness = [r.staleness(self.version) for r in trained]
        return accepted, old, {
            **take_metrics(outcomes), "n_returned_groups": returned, "verify_rounds": len(outcomes),
            "trained_staleness_max": max(staleness), "trained_staleness_mean": float(np.mean(staleness)),
        }

    def _verify(self, responses: list[Response], lps: list[np.ndarray]) -> VerifyOutcome:
        """The strategy's keep lengths against the step's policy, a response past the staleness bound restarting."""
        outcome = self.verifier.apply(responses, lps, self.version)
        stale = np.array([r.staleness(self.version) > self.algo.max_staleness for r in responses], bool)
        keep = outcome.keep_lengths = np.where(stale, 0, outcome.keep_lengths)
        nonempty = outcome.lengths > 0
        outcome.stats.update(restarted_stale=float(stale.sum()), kept_tokens=float(keep.sum()),
                             restarted=float(np.sum(nonempty & (keep == 0))),
                             truncated=float(np.sum((keep > 0) & (keep < outcome.lengths))))
        return outcome

    def _return(self, group: Group, keep: dict[str, int]) -> None:
        """A group that failed verification back into the buffer, cut; its cut responses regenerate their
        suffixes (a server revives a finished response it holds when it is cut; one it lost is resubmitted)."""
        self.feed.resubmit_lost()
        self.buffer.add_group(group)
        cuts = {rid: k for rid, k in keep.items() if k < self.buffer.get(rid).num_tokens}
        self.ledger.cut(self.buffer.apply_truncation(cuts))
        self.ledger.restarted += sum(1 for k in cuts.values() if k == 0)
        tracked = self.engine.response_ids()
        if on_engine := {rid: k for rid, k in cuts.items() if rid in tracked}:
            self.engine.truncate(on_engine)
        self.feed.submit([self.buffer.get(rid) for rid in cuts if rid not in tracked])

    # --- 2. train ---------------------------------------------------------------------------------------------

    def _train(self, groups: list[Group], old: list[np.ndarray]) -> dict[str, float]:
        rewards = torch.tensor(np.stack([g.rewards for g in groups]))
        advantages = grpo_advantages(rewards, use_std=self.algo.adv_use_std).reshape(-1).numpy()
        responses = [r for g in groups for r in g.responses]
        pending = self.calls.start(self.trainer.train_step, responses, advantages, self.cfg.temperature,
                                   self.version, old_logprobs=old)
        metrics = self.feed.await_call(pending)
        self.verifier.observe_floor(metrics.get("mismatch_ops_mean"))  # auto thresholds start from the floor
        self.version += 1
        tracked = self.engine.response_ids()
        if done := [r.response_id for r in responses if r.response_id in tracked]:
            self.engine.drop(done)
        self.ledger.trained += len(responses)
        self.ledger.trained_tokens += sum(r.num_policy_tokens for r in responses)
        self.ledger.trained_env_tokens += sum(r.num_env_tokens for r in responses)
        out = {TRAIN_PREFIX + k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        ops = [float(metrics[f"{k}_ops_mean"]) * float(metrics.get(f"{k}_tokens", 0.0))
               for k in ("mismatch", "drift") if metrics.get(f"{k}_ops_mean") is not None]
        n = sum(float(metrics.get(f"{k}_tokens", 0.0)) for k in ("mismatch", "drift") if f"{k}_ops_mean" in metrics)
        if n:
            out["trained_ops_mean"] = sum(ops) / n
        return out

    # --- 3. publish -------------------------------------------------------------------------------------------

    def _publish(self) -> dict[str, Any]:
        """Pause, (engine mode: verify the in-flight responses under the new weights), apply, resume."""
        self.feed.record(self.engine.pause())
        self.feed.record(self.engine.wait_finished(0.0))
        in_flight = sum(1 for r in self.buffer.pending() if r.num_tokens)
        out: dict[str, Any] = {"n_in_flight": in_flight}
        t0 = time.perf_counter()
        pushed = self.weights.push(self.version)
        out["sync_s"] = time.perf_counter() - t0
        if self.algo.verify_on == "engine":
            t1 = time.perf_counter()
            out.update(self._verify_in_flight())
            out["engine_verify_s"] = time.perf_counter() - t1
        out["n_restarted_stale"] = self._bound_staleness()
        self.engine.resume()
        return {**out, **{SYNC_PREFIX + k: v for k, v in pushed.items()}}

    def _verify_in_flight(self) -> dict[str, Any]:
        """The engines prefill their paused responses under the new weights (their resume needs it anyway) and
        return the log-probs; the verified prefixes resume, so no server decodes on a drifted prefix."""
        tracked = self.engine.response_ids()
        carried = [r for r in self.buffer.pending() if r.num_tokens and r.response_id in tracked]
        if not carried:
            return {}
        lps, on_engine = new_logprobs(carried, self.engine, self.trainer, "engine", self.cfg.temperature)
        outcome = self.verifier.apply(carried, lps, self.version)
        cuts = {rid: k for rid, k in outcome.decisions.items() if k < self.buffer.get(rid).num_tokens}
        cut = self.buffer.apply_truncation(cuts)
        self.ledger.cut(cut)
        self.ledger.restarted += sum(1 for k in cuts.values() if k == 0)
        if cuts:
            self.engine.truncate(cuts)
        return {**{ENGINE_VERIFY_PREFIX + k: v for k, v in outcome.stats.items()},
                ENGINE_VERIFY_PREFIX + "cut_tokens": float(cut.policy), ENGINE_VERIFY_PREFIX + "on_engine": float(on_engine)}

    def _bound_staleness(self) -> int:
        """Every buffer response holding a token more than `max_staleness` versions behind restarts (its oldest
        tokens are its first: nothing of it would pass the bound). Returns how many."""
        stale = {r.response_id: 0 for r in self.buffer.carried_over()
                 if r.staleness(self.version) > self.algo.max_staleness}
        if stale:
            self.ledger.cut(self.buffer.apply_truncation(stale))
            self.ledger.restarted += len(stale)
            tracked = self.engine.response_ids()
            if on_engine := {rid: 0 for rid in stale if rid in tracked}:
                self.engine.truncate(on_engine)
        return len(stale)

    # --- conditional fallback ---------------------------------------------------------------------------------

    def _switched(self, outcome: VerifyOutcome) -> bool:
        """One verification round's acceptance into the switch; True when it fires."""
        verified = int(outcome.lengths.sum())
        if self.switch is None or not verified:
            return False
        return self.switch.update(float(outcome.keep_lengths.sum()) / verified)

    # --- checkpoints ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able state (the buffer, with the queue and the in-flight responses, and the trainer are saved
        beside it). The engines' output since the last publish is not in it: a restored run regenerates it."""
        if self.fallback is not None:
            return {**self.fallback.state(), "schedule": "alternating", "fallback_mode": self.fallback.mode}
        return {"schedule": "async", "step": self.step, "version": self.version,
                "next_group_id": self.next_group_id, "ledger": asdict(self.ledger),
                "switch": self.switch.to_state() if self.switch is not None else None}

    def restore(self, state: dict[str, Any], buffer: RolloutBuffer) -> None:
        if state.get("schedule") == "alternating":  # the run had fallen back
            from rollverify.async_fallback import fallback_loop

            self.fallback = fallback_loop(self, state["fallback_mode"])
            self.fallback.restore(state, buffer)
            self.step, self.version, self.ledger = self.fallback.step, self.fallback.version, self.fallback.ledger
            return
        self.step, self.version = int(state["step"]), int(state["version"])
        self.ledger = Ledger(**state["ledger"])
        self.feed.attach(buffer, self.ledger)
        self.feed.next_group_id = int(state["next_group_id"])
        if self.switch is not None and state.get("switch"):
            self.switch = ConditionalSwitch.from_state(state["switch"])

    def close(self) -> None:
        """The engines stop generating and forget the run's responses (servers given by `rollout.endpoints`
        outlive the run; a resumed run resubmits from its checkpoint's buffer), and the worker thread ends."""
        try:
            if self.fallback is None:
                if not self.engine.paused:
                    self.engine.pause()
                if held := self.engine.response_ids():
                    self.engine.drop(sorted(held))
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
    ops = [(float(o.lengths.sum()), o.stats["ops_mean"]) for o in outcomes if np.isfinite(o.stats.get("ops_mean", np.nan))]
    s["acceptance_rate"] = s["kept_tokens"] / s["verified_tokens"] if s["verified_tokens"] else 1.0
    s["kept_whole_rate"] = float(whole.mean()) if whole.size else 1.0
    s["ops_mean"] = sum(n * v for n, v in ops) / sum(n for n, _ in ops) if ops else float("nan")
    return {**{VERIFY_PREFIX + k: v for k, v in s.items()},
            **{k: s[k] for k in ("acceptance_rate", "kept_whole_rate", "verified_tokens", "kept_tokens", "ops_mean")}}
