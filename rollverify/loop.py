"""The RollVerify step loop, as DESIGN.md tells it: rollout -> train -> verify -> resync.

For step k under policy version k:

1. Rollout: carried-over responses resume first (the engine kept them paused), unfinished ones it no longer
   holds are resubmitted from prompt + kept prefix, and new GRPO groups launch while capacity frees up. In the
   carry-over modes the phase ends as soon as B groups have finished and every live response is paused, its
   partial output recorded. In `on_policy` the phase completes exactly B groups: the buffer's first B (a
   backlog left by a switch; finished ones first, then oldest first), new ones for the rest; backlog groups
   beyond B wait off the engines, holding no tokens, for a later step.
2. Train: the first B finished groups make one optimizer step (version k -> k+1).
3. Verify: every response still in the buffer (all went stale) is checked against version k+1 by the
   strategy of the mode and cut to its verified prefix, in the buffer and on the engine; the strategy's
   statistics are logged whole under ``verify/``, a few of them also under their own names. The verification
   that switches to on_policy keeps the verified prefixes of the B groups the next step completes and sends
   every other group back to its prompt, off the engines: the switch wastes at most the backlog of that one
   step, and every later step generates only what it trains.
4. Resync: the new weights reach the engines, after the truncation decisions. With `algo.verify_on: engine`
   they reach them before step 3 instead, and the engines compute the new log-probs of the carried tokens
   (prefilling what resuming needs anyway) while they already generate the next step's new groups, the carried
   responses held until they are verified and cut; the trainer then runs no verification forward.

The loop owns the truth about every response (`RolloutBuffer`); the engine is a cache of it, so a crashed
server costs only the tokens since the last pause. `Ledger.check` holds the accounting invariant after each
step: every launched response is in the training data, carried over, or was dropped; no token is counted
twice or lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from rollverify.buffer import RolloutBuffer, TokenCounts
from rollverify.interfaces import Chunk, RolloutEngine, SamplingParams, Trainer, WeightSync
from rollverify.losses import grpo_advantages
from rollverify.sections import ConfigError, bounded
from rollverify.strategies import AlgoConfig, Strategy, VerifyOutcome, make_strategy
from rollverify.tool_turns import ToolTurns
from rollverify.types import Group, Response

VERIFY_PREFIX = "verify/"  # every statistic of the step's VerifyOutcome is logged under this prefix
TRAIN_PREFIX = "train/"  # every figure of the trainer's train_step (loss, entropy, clip fractions, ...) goes here
SYNC_PREFIX = "sync/"  # every statistic of the step's weight push (WeightSync.push) is logged under this prefix


class InMemoryWeights:
    """The local launcher's weight path: the trainer's HF-named buckets through this process to the engine;
    nothing to hand over between phases."""

    def __init__(self, engine: RolloutEngine, trainer: Trainer) -> None:
        self.engine, self.trainer = engine, trainer

    def before_training(self) -> None:
        pass

    def push(self, version: int) -> dict[str, float]:
        self.engine.update_weights(self.trainer.export_weights(), version)
        return {}


@dataclass
class RolloutConfig:
    """The rollout section: the loop's GRPO batch shape, sampling, concurrency and polling, and the servers the
    application starts for it (`n_servers`, `endpoints`, `engine_args`, `server_timeout_s`, `server_startup_s`)."""

    n_servers: int = bounded(1, ge=1)  # servers launched by `rollverify train` (ignored with endpoints)
    endpoints: list[str] = bounded(factory=list)  # connect to running servers instead of launching
    batch_groups: int = bounded(8, ge=1)  # B: finished groups per optimizer step
    n: int = bounded(4, ge=2)  # responses per prompt (GRPO group size)
    max_new_tokens: int = bounded(256, ge=1)
    temperature: float = bounded(1.0, gt=0.0)
    # Responses generated at once over all servers. Above B*n it over-provisions: extra groups run while the
    # slow tail finishes, which is where partial rollout gains its speed.
    max_live: int = bounded(64, ge=1)
    engine_args: dict[str, Any] = bounded(
        factory=dict
    )  # SGLang ServerArgs, e.g. {tp_size: 4, max_total_tokens: 8192}
    # A server that does not answer for this long is lost: its unfinished responses go to the others. Servers
    # `rollverify train` launched are also watched by process, and restarted when they exit.
    server_timeout_s: float = bounded(300.0, gt=0.0)
    # A server `rollverify train` launches that does not serve within this long is stopped (its log's last lines
    # in the error): a cold start of an 8B model with CUDA graph capture on a busy node takes many minutes
    server_startup_s: float = bounded(1800.0, gt=0.0)
    wait_s: float = bounded(0.05, ge=0.0)  # how long one poll for finished responses blocks
    phase_timeout_s: float = bounded(600.0, gt=0.0)  # a rollout phase that makes no progress this long is an error

    def check(self) -> None:
        """The rules between this section's keys; `ConfigError` naming the key."""
        if self.max_live < self.n:
            raise ConfigError(
                f"rollout.max_live: must be >= rollout.n ({self.n}) so one group fits, got {self.max_live}"
            )


@dataclass
class Ledger:
    """Token and response accounting across the whole run; the two token sources balance separately."""

    launched: int = 0  # responses launched (n per group)
    trained: int = 0  # responses consumed by optimizer steps
    generated_tokens: int = 0  # policy tokens ever recorded from the engines
    trained_tokens: int = 0  # policy tokens trained
    cut_tokens: int = 0  # policy tokens removed by verification or filters (they will be regenerated)
    restarted: int = 0  # responses sent back to their prompt by a filter or a cut to length 0
    env_tokens: int = 0  # environment tokens ever appended (tool outputs and their template text)
    trained_env_tokens: int = 0  # environment tokens in trained responses (loss mask 0)
    cut_env_tokens: int = 0  # environment tokens removed with the policy tokens before them

    def cut(self, counts: TokenCounts) -> None:
        self.cut_tokens += counts.policy
        self.cut_env_tokens += counts.env

    def check(self, buffer: RolloutBuffer) -> None:
        in_buffer = sum(len(g.responses) for g in buffer.groups.values())
        responses = [r for g in buffer.groups.values() for r in g.responses]
        buffered_env = sum(r.num_env_tokens for r in responses)
        buffered_tokens = sum(r.num_tokens for r in responses) - buffered_env
        if self.launched != self.trained + in_buffer:
            raise AssertionError(
                f"accounting: launched {self.launched} != trained {self.trained} + in buffer {in_buffer}"
            )
        if self.generated_tokens != self.trained_tokens + buffered_tokens + self.cut_tokens:
            raise AssertionError(
                f"accounting: generated {self.generated_tokens} policy tokens != trained {self.trained_tokens} + "
                f"buffered {buffered_tokens} + cut {self.cut_tokens}"
            )
        if self.env_tokens != self.trained_env_tokens + buffered_env + self.cut_env_tokens:
            raise AssertionError(
                f"accounting: appended {self.env_tokens} environment tokens != trained {self.trained_env_tokens} "
                f"+ buffered {buffered_env} + cut {self.cut_env_tokens}"
            )


@dataclass
class StepResult:
    metrics: dict[str, Any]
    trained_groups: list[Group] = field(default_factory=list)


class Loop:
    """One training run's state and its step function."""

    def __init__(self, cfg: RolloutConfig, algo: AlgoConfig, engine: RolloutEngine, trainer: Trainer,
                 make_group: Callable[[int], Group], reward: Callable[[Group, Response], float],
                 weights: WeightSync | None = None, tools: ToolTurns | None = None) -> None:
        self.cfg, self.algo = cfg, algo
        self.engine, self.trainer = engine, trainer
        self.weights: WeightSync = weights or InMemoryWeights(engine, trainer)
        self.make_group, self.reward = make_group, reward
        self.strategy: Strategy = make_strategy(algo.mode, algo)
        self.buffer = RolloutBuffer()
        self.ledger = Ledger()
        self.sampling = SamplingParams(temperature=cfg.temperature)
        self.tools = tools  # multi-turn: the tool turns between the engine and the tool runner
        if tools is not None:
            self.sampling = tools.sampling(self.sampling)
        self.step = 0
        self.version = 0
        self.next_group_id = 0
        # policy tokens each response received in this rollout phase (decode_iters: the most; a multi-turn
        # response receives them in several outputs, one a turn)
        self._phase_tokens: dict[str, int] = {}
        self._prefill_tokens = 0  # prompt + prefix tokens the engines prefilled since the last rollout phase ended

    # --- the loop -------------------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.strategy.mode

    def run_step(self) -> StepResult:
        t0 = time.perf_counter()
        mode = self.mode
        rollout = self.rollout()
        t1 = time.perf_counter()
        groups = self.buffer.pop_finished(self.cfg.batch_groups)
        self.weights.before_training()
        train_metrics = self.train(groups)
        t2 = time.perf_counter()
        verified, verify_s, sync_s = self._verify_and_sync()
        t4 = time.perf_counter()
        self.ledger.check(self.buffer)
        self.step += 1
        rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
        lengths = [r.num_tokens for g in groups for r in g.responses]
        metrics = {
            **train_metrics,
            **rollout,
            **verified,
            **(self.tools.step_stats([r for g in groups for r in g.responses]) if self.tools else {}),
            "step": self.step,
            "mode": mode,
            "policy_version": self.version,
            "reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
            "response_length_mean": float(np.mean(lengths)) if lengths else float("nan"),  # trained responses
            "n_finished_groups": len(groups),
            "rollout_s": t1 - t0,
            "train_s": t2 - t1,
            "verify_s": verify_s,
            "sync_s": sync_s,
            "step_s": t4 - t0,
        }
        return StepResult(metrics, groups)

    # --- 1. rollout -----------------------------------------------------------------------------------------

    def rollout(self) -> dict[str, Any]:
        cfg, buffer = self.cfg, self.buffer
        carries_over = self.strategy.carries_over
        generated_before, env_before = self.ledger.generated_tokens, self.ledger.env_tokens
        self._phase_tokens = {}
        self.engine.resume()
        # on_policy completes exactly B groups, the backlog's first; the carry-over modes keep the engines full
        phase = None if carries_over else on_policy_groups(buffer, cfg.batch_groups)
        runnable = [r for r in buffer.pending() if phase is None or r.group_id in phase]
        # after a restore, a lost server or a switch the engine no longer holds some unfinished responses
        resubmitted = self._resubmit_lost(phase)
        tracked = self.engine.response_ids()
        # a paused response resumes under new weights: the engine prefills its prompt and prefix again
        self._prefill_tokens += sum(_context(r) for r in runnable if r.response_id in tracked)
        self._submit([r for r in runnable if r.response_id not in tracked])
        launched_now = 0
        last_progress = time.monotonic()
        while True:
            launched_now += self._fill(phase)
            done = self._record(self.engine.wait_finished(cfg.wait_s)) + self._tool_outputs()
            resubmitted += self._resubmit_lost(phase)
            if done:
                last_progress = time.monotonic()
            if phase is None and buffer.num_finished >= cfg.batch_groups:
                break
            if phase is not None and len(phase) == cfg.batch_groups and all(buffer.groups[g].finished for g in phase):
                break  # on_policy: the phase's B groups have finished
            if time.monotonic() - last_progress > cfg.phase_timeout_s:
                raise TimeoutError(
                    f"rollout made no progress for {cfg.phase_timeout_s:.0f} s "
                    f"({self._num_live()} responses live on the engines)"
                )
        paused = self.engine.pause() if carries_over else []
        self._record(paused)
        self._record(self.engine.wait_finished(0.0))  # anything that finished while pausing
        prefill, self._prefill_tokens = self._prefill_tokens, 0
        return {
            "tokens_generated": self.ledger.generated_tokens - generated_before,
            "env_tokens_appended": self.ledger.env_tokens - env_before,
            # the phase's sequential decode iterations: every running sequence gains one token per engine
            # iteration, so the most tokens one response received in the phase is their number (exact while one
            # response runs through the whole phase, as the longest on-policy response and a carried long-tail
            # one do; capacity max_live <= the engine's max_running_requests). Hardware-neutral: on a GPU a
            # decode iteration costs about the same at batch 4 as at 64, on a CPU in proportion to the batch.
            "decode_iters": max(self._phase_tokens.values(), default=0),
            # prompt and prefix tokens the engines prefilled for the phase's launches, resumes and resubmissions
            # (each response counted whole: no prefix sharing assumed); rollverify/pricing.py prices them
            "prefill_tokens": prefill,
            "n_launched_groups": launched_now,
            "n_paused": len(paused),
            "n_resubmitted": resubmitted,
        }

    def _num_live(self) -> int:
        """Unfinished responses the engines hold (backlog groups waiting off the engines do not count)."""
        return sum(1 for rid in self.engine.response_ids() if not self.buffer.get(rid).finished)

    def _room(self) -> bool:
        return self._num_live() + self.cfg.n <= self.cfg.max_live

    def _fill(self, phase: list[int] | None) -> int:
        """Launch new groups while the engines have room (in on_policy, until the phase has B); returns how many."""
        launched = 0
        while self._room() and (phase is None or len(phase) < self.cfg.batch_groups):
            group_id = self._launch_group()
            if phase is not None:
                phase.append(group_id)
            launched += 1
        return launched

    def _launch_group(self) -> int:
        group = self.make_group(self.next_group_id)
        self.next_group_id += 1
        self.buffer.add_group(group)
        self.ledger.launched += group.n
        self._submit(group.responses)
        return group.group_id

    def _resubmit_lost(self, phase: list[int] | None) -> int:
        """The unfinished responses the engine lost with a server that this phase runs go back to it from the
        buffer (the others wait off the engines, like any response the engine does not hold)."""
        lost = self.engine.lost()
        again = [r for r in map(self.buffer.get, lost) if not r.finished and (phase is None or r.group_id in phase)]
        self._submit(again)
        return len(again)

    def _submit(self, responses: Sequence[Response]) -> None:
        if self.tools is not None:  # one waiting on a tool stays off the engine
            responses = self.tools.submittable(responses)
        if responses:
            self.engine.submit(responses, self.sampling)
            self._prefill_tokens += sum(_context(r) for r in responses)

    def pause_engines(self) -> None:
        """The engines stop generating, what they produced so far recorded (the next rollout resumes them): a
        colocated checkpoint or export between steps needs its servers idle to release their memory."""
        if not self.engine.paused:
            self._record(self.engine.pause())

    def _record(self, chunks: Sequence[Chunk]) -> int:
        """Append engine output to the buffer; score responses that finished, start the tool call of those that
        stopped at one. Returns how many finished or called."""
        finished = 0
        for c in chunks:
            if c.finish_reason == "error":
                raise RuntimeError(f"the engine failed response {c.response_id}: {c.error}")
            response = self.buffer.get(c.response_id)
            call = self.tools is not None and self.tools.is_call(c, response)
            self.buffer.record(
                c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts,
                finish_reason=None if call else c.finish_reason, finished=False if call else None, offset=c.offset,
                prompt_routes=c.prompt_routed_experts, prefix_routes=c.prefix_routed_experts,
            )
            self.ledger.generated_tokens += len(c.token_ids)
            self._phase_tokens[c.response_id] = self._phase_tokens.get(c.response_id, 0) + len(c.token_ids)
            if call:
                self.tools.start(response)
                finished += 1
            elif response.finished:
                response.reward = float(self.reward(self.buffer.groups[response.group_id], response))
                finished += 1
        return finished

    def _tool_outputs(self, wait_s: float = 0.0) -> int:
        """The finished tool calls' outputs appended and continued (`ToolTurns.deliver`); returns how many."""
        if self.tools is None:
            return 0
        delivered = self.tools.deliver(self.buffer, self.engine, wait_s)
        self.ledger.env_tokens += delivered.env_tokens
        for r in delivered.ended:
            r.reward = float(self.reward(self.buffer.groups[r.group_id], r))
        return delivered.continued + len(delivered.ended)

    def settle_tools(self) -> None:
        """Every tool call in flight finished and its output appended (before a checkpoint is written)."""
        while self.tools is not None and self.tools.pending:
            self._tool_outputs(wait_s=1.0)

    # --- 2. train -------------------------------------------------------------------------------------------

    def train(self, groups: list[Group]) -> dict[str, float]:
        if not groups:
            return {}
        rewards = torch.tensor(np.stack([g.rewards for g in groups]))
        advantages = grpo_advantages(rewards, use_std=self.algo.adv_use_std).reshape(-1).numpy()
        responses = [r for g in groups for r in g.responses]
        metrics = self.trainer.train_step(responses, advantages, self.cfg.temperature, self.version)
        self.strategy.observe_floor(metrics.get("mismatch_ops_mean"))  # auto thresholds start from the floor
        self.version += 1
        on_engine = self.engine.response_ids()
        tracked = [r.response_id for r in responses if r.response_id in on_engine]
        if tracked:
            self.engine.drop(tracked)
        self.ledger.trained += len(responses)
        self.ledger.trained_tokens += sum(r.num_policy_tokens for r in responses)
        self.ledger.trained_env_tokens += sum(r.num_env_tokens for r in responses)
        ops = _trained_ops(responses, metrics)
        return {**{TRAIN_PREFIX + k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}, **ops}

    # --- 3. verify ------------------------------------------------------------------------------------------

    def _verify_and_sync(self) -> tuple[dict[str, Any], float, float]:
        """Steps 3 and 4 in the order of `algo.verify_on`; returns (verification metrics, verify_s, sync_s).

        trainer: verify (the trainer computes the new log-probs), then the new weights reach the engines.
        engine: the new weights reach the engines first; they prefill the carried responses under them, which
        resuming needs anyway, and return the log-probs; the cut prefixes then resume from their cached KV. The
        wait for those log-probs is the resume's prefill, while the engines also generate the next step's new
        groups (`_hold_and_fill`): it is logged as `logprob_wait_s`, outside verify_s."""
        engine_side = self.algo.verify_on == "engine"
        pushed: dict[str, float] = {}
        t0 = time.perf_counter()
        if engine_side:
            pushed = self.weights.push(self.version)
        t1 = time.perf_counter()
        metrics = self.verify()
        t2 = time.perf_counter()
        if not engine_side:
            pushed = self.weights.push(self.version)
        t3 = time.perf_counter()
        metrics.update({SYNC_PREFIX + k: v for k, v in pushed.items()})
        return metrics, t2 - t1 - metrics.get("logprob_wait_s", 0.0), (t1 - t0) + (t3 - t2)

    def verify(self) -> dict[str, Any]:
        """Verify and cut the carried-over responses; returns the step's verification metrics. Three jobs in
        order: decide (the new log-probs and the strategy's keep lengths), apply (the cuts to the buffer and the
        ledger, and at a switch the backlog off the engines), send (the cuts and releases to the engine)."""
        carried = self.buffer.carried_over()
        stats: dict[str, Any] = {"n_carried": len(carried)}
        if not carried:
            return {**stats, "ops_mean": float("nan"), "acceptance_rate": float("nan"), "kept_whole_rate": float("nan"),
                    "switched": False}
        outcome, unverified = self._decide(carried, stats)
        cut, shelved_cut, shelved = self._apply(outcome)
        self._send(outcome, shelved, unverified)
        return {**stats, **verify_metrics(outcome, cut, shelved_cut)}

    def _decide(self, carried: list[Response], stats: dict[str, Any]) -> tuple[VerifyOutcome, list[str] | None]:
        """The strategy's outcome over the carried responses, from their new log-probs where it needs them (or
        `algo.monitor_ops` asks for them), and the ids the engines hold back until they are cut (engine mode).
        Adds to `stats` where the log-probs came from and how long the engines took."""
        new_lp = None
        unverified: list[str] | None = None  # engine mode: the carried responses held while the engines run
        if self.strategy.needs_new_logprobs or self.algo.monitor_ops:
            engine_side = self.algo.verify_on == "engine"
            t0 = time.perf_counter()
            if engine_side and self.engine.paused and self.strategy.carries_over:
                unverified, stats["n_launched_while_verifying"] = self._hold_and_fill(carried)
            new_lp, on_engine = new_logprobs(carried, self.engine, self.trainer, self.algo.verify_on,
                                             self.cfg.temperature)
            stats["n_logprobs_on_engine"] = on_engine
            if engine_side:
                stats["logprob_wait_s"] = time.perf_counter() - t0
        return self.strategy.apply(carried, new_lp, self.version), unverified

    def _apply(self, outcome: VerifyOutcome) -> tuple[TokenCounts, TokenCounts, set[str]]:
        """The outcome's cuts in the buffer and the ledger; at a switch to on_policy also the backlog's restart.
        Returns (tokens cut, of them the backlog's, the backlog's response ids)."""
        cut = self.buffer.apply_truncation(outcome.decisions)
        self.ledger.restarted += int(sum(1 for k in outcome.keep_lengths if k == 0))
        shelved, shelved_cut = set(), TokenCounts()
        if outcome.switched:  # every group but the B the next step completes restarts and leaves the engines
            shelved, shelved_cut, restarted = shelve_backlog(self.buffer, self.cfg.batch_groups)
            self.ledger.restarted += restarted
        cut += shelved_cut
        self.ledger.cut(cut)
        if self.tools is not None:  # a call cut before its stop token delivers nothing
            self.tools.forget_cut(self.buffer)
        return cut, shelved_cut, shelved

    def _send(self, outcome: VerifyOutcome, shelved: set[str], unverified: list[str] | None) -> None:
        """What the buffer now says, to the engine: the backlog dropped, the cut prefixes truncated (after a
        pause in on_policy, so that nothing relaunches before the weights move), the held responses released."""
        tracked = self.engine.response_ids()
        cuts = {
            rid: int(k)
            for rid, k, n in zip(outcome.response_ids, outcome.keep_lengths, outcome.lengths, strict=True)
            if k < n and rid in tracked and rid not in shelved
        }
        if shelved & tracked:
            self.engine.drop(sorted(shelved & tracked))
        if cuts:
            if not self.engine.paused and unverified is None:
                self._record(self.engine.pause())
            self.engine.truncate(cuts)
        if unverified:
            tracked = self.engine.response_ids()
            self.engine.release([rid for rid in unverified if rid in tracked])

    def _hold_and_fill(self, carried: list[Response]) -> tuple[list[str], int]:
        """With `verify_on: engine` after a carry-over phase (the engines paused, the new weights theirs): the
        engines resume with the unfinished carried responses held (paused until verified and cut, then
        `release`d) and the next step's new groups launch into the room, so that the engines generate them while
        they prefill the carried ones. Returns (the held ids, groups launched). A finished carried response the
        verification cuts becomes live again: until the next finish the engines may then hold up to that many
        more than `max_live` (SGLang queues what its `max_running_requests` does not take)."""
        tracked = self.engine.response_ids()
        waiting = self.tools.waiting if self.tools is not None else (lambda _: False)
        unverified = [r.response_id for r in carried if r.response_id in tracked and not r.finished
                      and not waiting(r.response_id)]
        self.engine.resume(hold=unverified)
        return unverified, self._fill(None)

    # --- checkpoints ----------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able loop state (the buffer and the trainer are saved beside it)."""
        return {
            "step": self.step,
            "version": self.version,
            "next_group_id": self.next_group_id,
            "ledger": asdict(self.ledger),
            "strategy": self.strategy.to_state(),
        }

    def restore(self, state: dict[str, Any], buffer: RolloutBuffer) -> None:
        self.step, self.version = int(state["step"]), int(state["version"])
        self.next_group_id = int(state["next_group_id"])
        self.ledger = Ledger(**state["ledger"])
        self.strategy.load_state(state["strategy"])
        self.buffer = buffer  # the engine of a restored run holds none of it: the rollout resubmits the unfinished


def on_policy_groups(buffer: RolloutBuffer, batch_groups: int) -> list[int]:
    """The buffer groups an on_policy phase completes: finished ones in completion order, then the others
    oldest first, at most B."""
    completed = set(buffer.completed)
    waiting = sorted(g for g in buffer.groups if g not in completed)
    return [*buffer.completed, *waiting][:batch_groups]


def new_logprobs(carried: list[Response], engine: RolloutEngine, trainer: Trainer, verify_on: str,
                 temperature: float) -> tuple[list[np.ndarray], int]:
    """Log-probs of the carried tokens under the new policy, and how many responses the engines computed.

    With `verify_on: engine` the engines compute them for every response they hold (the weights are already
    theirs); the trainer computes the rest: responses the engines do not hold (after a restore, a lost server)
    or lost while computing (None)."""
    out: list[np.ndarray | None] = [None] * len(carried)
    on_engine = engine.response_ids()
    tracked = [i for i, r in enumerate(carried) if r.response_id in on_engine]
    if verify_on == "engine" and tracked:
        for i, lp in zip(tracked, engine.compute_logprobs([carried[i] for i in tracked]), strict=True):
            out[i] = lp
    rest = [i for i, lp in enumerate(out) if lp is None]
    if rest:
        for i, lp in zip(rest, trainer.compute_logprobs([carried[i] for i in rest], temperature), strict=True):
            out[i] = lp
    return out, len(carried) - len(rest)  # type: ignore[return-value]


def shelve_backlog(buffer: RolloutBuffer, batch_groups: int) -> tuple[set[str], TokenCounts, int]:
    """At the switch to on_policy: every group but the B the next step completes restarts from its prompt and
    waits off the engines until an on_policy phase takes it. Returns (its response ids, tokens cut, responses
    restarted)."""
    keep = set(on_policy_groups(buffer, batch_groups))
    shelved = [r for g in buffer.groups.values() if g.group_id not in keep for r in g.responses]
    restarted = sum(1 for r in shelved if r.num_tokens)
    cut = buffer.apply_truncation({r.response_id: 0 for r in shelved if r.num_tokens})
    return {r.response_id for r in shelved}, cut, restarted


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
        **({"cut_env_tokens": float(cut.env)} if cut.env else {}),
        "switched": bool(outcome.switched),
        **({"switch_reason": outcome.switch_reason} if outcome.switched else {}),
    }


def _context(r: Response) -> int:
    """Tokens an engine prefills to (re)start a response: its prompt and what it holds."""
    return len(r.prompt_ids) + r.num_tokens


def _trained_ops(responses: Sequence[Response], metrics: dict) -> dict[str, float]:
    """Mean OPS of the trained tokens against the policy that trained on them (the trainer's recomputed old
    log-probs against the engine's, over its own tokens' mismatch and older tokens' drift alike), the figure
    partial rollout lets grow and verification keeps small."""
    parts = [(float(metrics.get(f"{k}_tokens", 0.0)), metrics.get(f"{k}_ops_mean")) for k in ("mismatch", "drift")]
    n = sum(t for t, v in parts if v is not None)
    if not n:
        return {}
    value = sum(t * float(v) for t, v in parts if v is not None) / n
    return {"trained_ops_mean": value} if math.isfinite(value) else {}
