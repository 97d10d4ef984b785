"""The driver's side of a run: every response from its launch to its training, whichever schedule drives it.

`Rollout` owns the run's `RolloutBuffer` (the truth about every response), its `Ledger`, the rollout engine
(a cache of the buffer: a crashed server costs only the tokens since the last report), the tool turns, the
policy version and the step. The schedules drive it: the alternating `rollverify.loop.Loop` in phases, the
asynchronous `rollverify.async_loop.AsyncLoop` continuously; the asynchronous schedule's fallback hands the same
object to an alternating `Loop`. A schedule decides when to launch, wait, verify, train and publish; what each of
those does to a response is defined here, once:

- live: an unfinished buffer response the engines hold (one stopped at a tool call included); a group waiting
  off the engines and a group a step has taken are not live. At most `rollout.max_live` are (`fill`).
- launching new GRPO groups into the room (`fill`), submitting what the engines miss (`submit_missing`: after a
  restore, a switch, a cut of a response whose server was lost) and resubmitting a lost server's responses from
  their prefixes (`resubmit_lost`);
- recording engine output (`record`): a response that finished is scored, one that stopped at a tool call has
  its call started, and a finished call's output is appended and continued (`deliver`);
- cutting responses to their verified prefixes (`cut`: buffer, ledger and tool turns at once, the engines at
  `send`), and shelving (`shelve`: groups back to their prompts, off the engines);
- training B groups with its accounting and the trained tokens' OPS (`train`);
- the step's record (`StepCounts`, `end_step`), with `Ledger.check` after every step: every launched response is
  in the training data, in the buffer, or was cut back; no token is counted twice or lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from rollverify.buffer import RolloutBuffer, TokenCounts
from rollverify.interfaces import Chunk, RolloutEngine, SamplingParams, Trainer, WeightSync
from rollverify.losses import grpo_advantages
from rollverify.sections import ConfigError, bounded
from rollverify.tool_turns import ToolTurns
from rollverify.types import Group, Response

VERIFY_PREFIX = "verify/"  # every statistic of a step's verification is logged under this prefix
TRAIN_PREFIX = "train/"  # every figure of the trainer's train_step (loss, entropy, clip fractions, ...) goes here
SYNC_PREFIX = "sync/"  # every statistic of the step's weight push (WeightSync.push) is logged under this prefix


@dataclass
class RolloutConfig:
    """The rollout section: the loop's GRPO batch shape, sampling, concurrency and polling. The servers it runs
    on are the engine wing's section (`servers`)."""

    batch_groups: int = bounded(8, ge=1)  # B: finished groups per optimizer step
    n: int = bounded(4, ge=2)  # responses per prompt (GRPO group size)
    max_new_tokens: int = bounded(256, ge=1)
    temperature: float = bounded(1.0, gt=0.0)
    # Responses generated at once over all servers. Above B*n it over-provisions: extra groups run while the
    # slow tail finishes, which is where partial rollout gains its speed.
    max_live: int = bounded(64, ge=1)
    wait_s: float = bounded(0.05, ge=0.0)  # how long one poll for finished responses blocks
    phase_timeout_s: float = bounded(600.0, gt=0.0)  # a rollout phase that makes no progress this long is an error

    RETIRED: ClassVar[dict[str, str]] = {
        "n_servers": "set servers.count",
        "endpoints": "set servers.endpoints",
        "engine_args": "set servers.engine_args (the same SGLang keys; those the project reads are typed there)",
        "server_timeout_s": "set servers.timeout_s",
        "server_startup_s": "set servers.startup_s",
    }

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
class StepCounts:
    """What the engines did for the driver in one step (the alternating loop's rollout phase, the asynchronous
    schedule's whole step): the step record's rollout figures (`figures`)."""

    generated_from: int = 0  # the ledger's generated policy tokens when the step began
    env_from: int = 0  # and its appended environment tokens
    tokens: dict[str, int] = field(default_factory=dict)  # policy tokens each response received in the step
    launched_groups: int = 0
    resubmitted: int = 0  # a lost server's responses resubmitted
    prefill: int = 0  # prompt + prefix tokens the engines prefilled for launches, resumes and resubmissions

    def figures(self, ledger: Ledger) -> dict[str, Any]:
        return {
            "tokens_generated": ledger.generated_tokens - self.generated_from,
            "env_tokens_appended": ledger.env_tokens - self.env_from,
            # The step's sequential decode iterations: every running sequence gains one token per engine
            # iteration, so the most policy tokens one response received in the step is their number (exact
            # while one response runs through the whole step, as the longest on-policy response, a carried
            # long-tail one and an asynchronous step's longest do; capacity max_live <= the engine's
            # max_running_requests; a multi-turn response receives them in several outputs, one a turn).
            # Hardware-neutral: on a GPU a decode iteration costs about the same at batch 4 as at 64, on a CPU
            # in proportion to the batch.
            "decode_iters": max(self.tokens.values(), default=0),
            # each response counted whole (no prefix sharing assumed); rollverify/pricing.py prices them
            "prefill_tokens": self.prefill,
            "n_launched_groups": self.launched_groups,
            "n_resubmitted": self.resubmitted,
        }


class PushOrder(Protocol):
    """The order a weight push keeps with the GPUs' other holders (rollverify.app.handoff.Handoff)."""

    def before_training(self) -> None: ...

    def push(self, send: Callable[[], dict[str, float]]) -> dict[str, float]: ...


class InMemoryWeights:
    """The `WeightSync` of the local launcher: the trainer's HF-named buckets through this process to the engine.
    `order`, when given, wraps each push and the start of training in the GPUs' hand-over (colocated: the
    servers release and resume their memory around the trainer's phases; elsewhere it only records them)."""

    def __init__(self, engine: RolloutEngine, trainer: Trainer, order: PushOrder | None = None) -> None:
        self.engine, self.trainer, self.order = engine, trainer, order

    def before_training(self) -> None:
        if self.order is not None:
            self.order.before_training()

    def push(self, version: int) -> dict[str, float]:
        def send() -> dict[str, float]:
            self.engine.update_weights(self.trainer.export_weights(), version)
            return {}

        return send() if self.order is None else self.order.push(send)


def call_here(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A trainer call made by the driver itself, the engines waiting (the alternating schedule's)."""
    return fn(*args, **kwargs)


class Rollout:
    """The driver's handling of every response of one run (see the module docstring)."""

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, trainer: Trainer,
                 make_group: Callable[[int], Group], reward: Callable[[Group, Response], float], *,
                 weights: WeightSync | None = None, tools: ToolTurns | None = None) -> None:
        self.cfg = cfg
        self.engine, self.trainer = engine, trainer
        self.weights: WeightSync = weights or InMemoryWeights(engine, trainer)
        self.make_group, self.reward = make_group, reward
        self.tools = tools  # multi-turn: the tool turns between the engine and the tool runner
        self.sampling = SamplingParams(temperature=cfg.temperature)
        if tools is not None:
            self.sampling = tools.sampling(self.sampling)
        self.buffer = RolloutBuffer()
        self.ledger = Ledger()
        self.version = 0  # the policy the trainer holds: the next step trains from it
        self.step = 0  # optimizer steps done
        self.next_group_id = 0
        self.counts = StepCounts()
        self._unsent: dict[str, int] = {}  # cuts the engines have not been sent (response id -> tokens kept)
        self._shelved: set[str] = set()  # shelved responses the engines have not dropped yet
        self._progress_at = time.monotonic()

    # --- the engines' state -------------------------------------------------------------------------------

    def held(self, response_id: str) -> Response | None:
        """The buffer's response of this id; None while it is out of the buffer (its group taken by a step)."""
        try:
            return self.buffer.get(response_id)
        except KeyError:
            return None

    def live(self) -> int:
        """Live responses (module docstring): unfinished buffer responses the engines hold."""
        n = 0
        for rid in self.engine.response_ids():
            r = self.held(rid)
            n += r is not None and not r.finished
        return n

    def first_groups(self) -> list[int]:
        """The buffer groups the next B trained ones come from, in order: finished ones in completion order,
        then the others oldest first (at most B)."""
        completed = set(self.buffer.completed)
        waiting = sorted(g for g in self.buffer.groups if g not in completed)
        return [*self.buffer.completed, *waiting][: self.cfg.batch_groups]

    # --- launching and resubmitting -----------------------------------------------------------------------

    def fill(self, max_groups: int | None = None) -> list[int]:
        """Launch new groups while n more responses fit beside the live ones, at most `max_groups`; returns
        their ids."""
        launched: list[int] = []
        live = self.live()
        while live + self.cfg.n <= self.cfg.max_live and (max_groups is None or len(launched) < max_groups):
            group = self.make_group(self.next_group_id)
            self.next_group_id += 1
            self.buffer.add_group(group)
            self.ledger.launched += group.n
            self.submit(group.responses)
            live += group.n
            launched.append(group.group_id)
        self.counts.launched_groups += len(launched)
        return launched

    def submit(self, responses: Sequence[Response]) -> None:
        """Generate these responses from prompt + their tokens; one waiting on a tool call stays off the engines
        (and one that ends in a call without its output has it run first: `ToolTurns.submittable`)."""
        if self.tools is not None:
            responses = self.tools.submittable(responses)
        if responses:
            self.engine.submit(responses, self.sampling)
            self.counts.prefill += sum(context_tokens(r) for r in responses)

    def resume(self) -> None:
        """The engines generate again; the unfinished responses they hold prefill their prompt and prefix again
        under the weights pushed meanwhile."""
        held = [self.held(rid) for rid in self.engine.response_ids()]
        self.counts.prefill += sum(context_tokens(r) for r in held if r is not None and not r.finished)
        self.engine.resume()

    def submit_missing(self, groups: Collection[int] | None = None) -> int:
        """Submit every unfinished buffer response (of `groups`, when given) that the engines do not hold;
        returns how many."""
        tracked = self.engine.response_ids()
        missing = [r for r in self.buffer.pending()
                   if r.response_id not in tracked and (groups is None or r.group_id in groups)]
        self.submit(missing)
        return len(missing)

    def resubmit_lost(self, groups: Collection[int] | None = None) -> int:
        """The unfinished responses the engine lost with a server go back to it from the buffer (of `groups`,
        when given; the others wait off the engines, as any response the engine does not hold). A finished one is
        kept whole, and one of a group a step has taken is the step's to give back. Returns how many."""
        again = [r for rid in self.engine.lost() if (r := self.held(rid)) is not None and not r.finished
                 and (groups is None or r.group_id in groups)]
        self.submit(again)
        self.counts.resubmitted += len(again)
        return len(again)

    # --- output -------------------------------------------------------------------------------------------

    def record(self, chunks: Sequence[Chunk]) -> int:
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
            self.counts.tokens[c.response_id] = self.counts.tokens.get(c.response_id, 0) + len(c.token_ids)
            if call:
                assert self.tools is not None
                self.tools.start(response)
                finished += 1
            elif response.finished:
                response.reward = float(self.reward(self.buffer.groups[response.group_id], response))
                finished += 1
        return finished

    def deliver(self, wait_s: float = 0.0) -> int:
        """The finished tool calls' outputs appended and continued (`ToolTurns.deliver`); returns how many."""
        if self.tools is None:
            return 0
        delivered = self.tools.deliver(self.buffer, self.engine, wait_s)
        self.ledger.env_tokens += delivered.env_tokens
        for r in delivered.ended:
            r.reward = float(self.reward(self.buffer.groups[r.group_id], r))
        return delivered.continued + len(delivered.ended)

    def poll(self, groups: Collection[int] | None = None) -> int:
        """One round of the engines' feed (a schedule launches first, `fill`): wait up to `rollout.wait_s` for
        output and record it, deliver the finished tool calls, resubmit a lost server's responses (of `groups`).
        Returns how many responses finished, called a tool or had a call answered."""
        done = self.record(self.engine.wait_finished(self.cfg.wait_s)) + self.deliver()
        self.resubmit_lost(groups)
        if done:
            self._progress_at = time.monotonic()
        return done

    def expect_progress(self) -> None:
        """A wait for output begins: `stalled` counts from now."""
        self._progress_at = time.monotonic()

    def stalled(self) -> bool:
        """No response finished, called or had a call answered for `rollout.phase_timeout_s` of a wait."""
        return time.monotonic() - self._progress_at > self.cfg.phase_timeout_s

    def pause(self) -> int:
        """The engines stop generating; what they produced up to the pause, and whatever finished meanwhile, is
        recorded. Returns how many were paused."""
        paused = self.engine.pause()
        self.record(paused)
        self.record(self.engine.wait_finished(0.0))
        return len(paused)

    def pause_engines(self) -> None:
        """The engines paused between steps (the next step resumes them): a colocated checkpoint or export needs
        its servers idle to release their memory."""
        if not self.engine.paused:
            self.pause()

    def settle_tools(self) -> None:
        """Every tool call in flight finished and its output appended (before a checkpoint is written: none runs
        again after a restore)."""
        while self.tools is not None and self.tools.pending:
            self.deliver(wait_s=1.0)

    # --- cuts ---------------------------------------------------------------------------------------------

    def cut(self, decisions: dict[str, int]) -> TokenCounts:
        """Cut buffer responses to their keep lengths (response id -> tokens kept): in the buffer, the ledger
        (a response with tokens cut to none restarts) and the tool turns (a call whose own tokens were cut
        delivers nothing) now, on the engines at the next `send`. Returns the tokens cut."""
        restarted = 0
        for rid, keep in decisions.items():
            if keep < self.buffer.get(rid).num_tokens:
                self._unsent[rid] = int(keep)
                restarted += keep == 0
        counts = self.buffer.apply_truncation(decisions)
        self.ledger.cut(counts)
        self.ledger.restarted += restarted
        if self.tools is not None:
            self.tools.forget_cut(self.buffer)
        return counts

    def shelve(self) -> tuple[set[str], TokenCounts]:
        """Every buffer group but the `first_groups` back to its prompt, waiting off the engines (dropped at the
        next `send`) until a phase takes it, holding no tokens: what the switch to on_policy does with the
        backlog. Returns (its response ids, the tokens cut)."""
        keep = set(self.first_groups())
        shelved = [r for g in self.buffer.groups.values() if g.group_id not in keep for r in g.responses]
        counts = self.cut({r.response_id: 0 for r in shelved if r.num_tokens})
        ids = {r.response_id for r in shelved}
        self._shelved |= ids
        return ids, counts

    def defer(self) -> tuple[int, TokenCounts]:
        """On-policy tail batching's end of a regular round: the engines pause (what they generated is recorded),
        every group but the first B finished ones goes back to its prompt (`shelve`: partial responses dropped,
        so nothing older than the next step's policy is ever trained) and leaves the engines. Returns (groups
        deferred, the tokens dropped)."""
        self.pause()
        keep = set(self.first_groups())
        deferred = sum(1 for g in self.buffer.groups if g not in keep)
        counts = self.shelve()[1]
        self.send()
        return deferred, counts

    def send(self, *, relaunch: bool = True) -> None:
        """What the buffer now says, to the engines: shelved responses dropped, cut ones truncated to their kept
        prefix (a finished one cut short revives). A generating engine relaunches a revived response at once;
        with `relaunch` False the engines are paused first (the next weights are not theirs yet). Responses the
        engines no longer hold are the schedule's to submit (`submit_missing`)."""
        tracked = self.engine.response_ids()
        cuts = {rid: k for rid, k in self._unsent.items() if rid in tracked and rid not in self._shelved}
        off = self._shelved & tracked
        self._unsent, self._shelved = {}, set()
        if off:
            self.engine.drop(sorted(off))
        if cuts:
            if not relaunch and not self.engine.paused:
                self.pause()
            self.engine.truncate(cuts)

    # --- verification's inputs ----------------------------------------------------------------------------

    def new_logprobs(self, carried: list[Response], *, on_engine: bool) -> tuple[list[np.ndarray], int]:
        """Log-probs of the carried responses' tokens under the policy the trainer holds, and how many the
        engines computed. `on_engine` (`algo.verify_on: engine`, the weights already theirs): the engines
        compute them for every response they hold; the trainer computes the rest: responses the engines do not
        hold (after a restore, a lost server) or lost while computing (None)."""
        out: list[np.ndarray | None] = [None] * len(carried)
        tracked = self.engine.response_ids()
        held = [i for i, r in enumerate(carried) if r.response_id in tracked]
        if on_engine and held:
            for i, lp in zip(held, self.engine.compute_logprobs([carried[i] for i in held]), strict=True):
                out[i] = lp
        rest = [i for i, lp in enumerate(out) if lp is None]
        if rest:
            lps = self.trainer.compute_logprobs([carried[i] for i in rest], self.cfg.temperature)
            for i, lp in zip(rest, lps, strict=True):
                out[i] = lp
        return out, len(carried) - len(rest)  # type: ignore[return-value]

    # --- training -----------------------------------------------------------------------------------------

    def train(self, groups: list[Group], use_std: bool, old_logprobs: list[np.ndarray] | None = None,
              call: Callable[..., Any] = call_here) -> dict[str, float]:
        """One optimizer step on finished `groups` (version k -> k+1; `old_logprobs`: the trainer's own for them
        under version k, computed ahead), made through `call` (`call_here`, or the asynchronous schedule's
        worker while the engines are fed). The trained responses leave the engines and enter the ledger.
        Returns the trainer's figures under train/ and the trained tokens' OPS."""
        if not groups:
            return {}
        rewards = torch.tensor(np.stack([g.rewards for g in groups]))
        advantages = grpo_advantages(rewards, use_std=use_std).reshape(-1).numpy()
        responses = [r for g in groups for r in g.responses]
        ahead = {} if old_logprobs is None else {"old_logprobs": old_logprobs}
        metrics = call(self.trainer.train_step, responses, advantages, self.cfg.temperature, self.version, **ahead)
        self.version += 1
        tracked = self.engine.response_ids()
        if done := [r.response_id for r in responses if r.response_id in tracked]:
            self.engine.drop(done)
        self.ledger.trained += len(responses)
        self.ledger.trained_tokens += sum(r.num_policy_tokens for r in responses)
        self.ledger.trained_env_tokens += sum(r.num_env_tokens for r in responses)
        return {**{TRAIN_PREFIX + k: float(v) for k, v in metrics.items() if isinstance(v, int | float)},
                **trained_ops(metrics)}

    # --- the step record ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The step's rollout figures count from now (`StepCounts`)."""
        self.counts = StepCounts(self.ledger.generated_tokens, self.ledger.env_tokens)

    def end_step(self, groups: list[Group]) -> dict[str, Any]:
        """The step is done: the ledger holds (AssertionError naming the books that do not balance), the step
        counts, and the record's common part (the trained groups' rewards and lengths, the tool turns')."""
        self.ledger.check(self.buffer)
        self.step += 1
        trained = [r for g in groups for r in g.responses]
        return self._record(groups, self.tools.step_stats(trained) if self.tools is not None else {})

    def record_keys(self) -> list[str]:
        """The keys of `end_step`'s record."""
        return list(self._record([], dict.fromkeys(self.tools.stat_keys()) if self.tools is not None else {}))

    def _record(self, groups: list[Group], tool_stats: dict[str, Any]) -> dict[str, Any]:
        trained = [r for g in groups for r in g.responses]
        rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
        return {
            **tool_stats,
            "step": self.step,
            "policy_version": self.version,
            "reward_mean": float(rewards.mean()) if rewards.size else float("nan"),
            "response_length_mean": float(np.mean([r.num_tokens for r in trained])) if trained else float("nan"),
            "n_finished_groups": len(groups),
        }

    # --- checkpoints --------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-able state (the buffer and the trainer are saved beside it)."""
        return {"step": self.step, "version": self.version, "next_group_id": self.next_group_id,
                "ledger": asdict(self.ledger)}

    def restore(self, state: dict[str, Any], buffer: RolloutBuffer) -> None:
        """The state of a checkpoint; the engines of a restored run hold none of `buffer`: the schedule submits
        its unfinished responses."""
        self.step, self.version = int(state["step"]), int(state["version"])
        self.next_group_id = int(state["next_group_id"])
        self.ledger = Ledger(**state["ledger"])
        self.buffer = buffer


class Schedule:
    """What a schedule shows of its run: the `Rollout` it drives, and views of the state that object owns."""

    rollout: Rollout

    @property
    def cfg(self) -> RolloutConfig:
        return self.rollout.cfg

    @property
    def buffer(self) -> RolloutBuffer:
        return self.rollout.buffer

    @property
    def ledger(self) -> Ledger:
        return self.rollout.ledger

    @property
    def engine(self) -> RolloutEngine:
        return self.rollout.engine

    @property
    def trainer(self) -> Trainer:
        return self.rollout.trainer

    @property
    def weights(self) -> WeightSync:
        return self.rollout.weights

    @property
    def tools(self) -> ToolTurns | None:
        return self.rollout.tools

    @property
    def version(self) -> int:
        return self.rollout.version

    @property
    def step(self) -> int:
        return self.rollout.step

    @property
    def next_group_id(self) -> int:
        return self.rollout.next_group_id

    def pause_engines(self) -> None:
        self.rollout.pause_engines()

    def settle_tools(self) -> None:
        self.rollout.settle_tools()

    def close(self) -> None:
        """The schedule's own resources released (the engine and the trainer are the application's)."""


def context_tokens(r: Response) -> int:
    """Tokens an engine prefills to (re)start a response: its prompt and what it holds."""
    return len(r.prompt_ids) + r.num_tokens


def trained_ops(metrics: dict) -> dict[str, float]:
    """Mean OPS of the trained tokens against the policy that trained on them (the trainer's recomputed old
    log-probs against the engine's, over its own tokens' mismatch and older tokens' drift alike), the figure
    partial rollout lets grow and verification keeps small; NaN when there is nothing (finite) to measure."""
    parts = [(float(metrics.get(f"{k}_tokens", 0.0)), metrics.get(f"{k}_ops_mean")) for k in ("mismatch", "drift")]
    parts = [(t, float(v)) for t, v in parts if t > 0 and v is not None]
    n = sum(t for t, _ in parts)
    value = sum(t * v for t, v in parts) / n if n else math.nan
    return {"trained_ops_mean": value if math.isfinite(value) else math.nan}
