"""Tool turns of a multi-turn rollout: what the loop calls between the engine and the tool runner.

A trajectory's policy turn ends where generation stops at the tool-call stop token (`</tool_call>` of the Qwen3
chat template, one token in Qwen3's vocabulary and the tiny model's). The loop records the turn unfinished and
`start`s its call: the turn's text is parsed and run on the bounded `ToolRunner` while the engines keep
generating the other trajectories. `deliver` appends each finished call's environment text (the tool-response
turn and the next generation prompt) to the response as environment tokens and has the engine continue it, with
its remaining token and turn budget. A malformed call, an unknown tool, a tool error and a time-out are
environment text like any output (`ToolRunner` never raises); a call past `max_turns` ends the trajectory where
it stands (the reward judges it), and so does an output that leaves no token of the budget.

A pause can find a trajectory generating (the engine aborts it; its partial turn is kept, as any response's),
waiting on a tool (its call runs on; the output is appended at the next `deliver`, once: a call is never run
twice), or between turns (its output was appended, the engine continues it at resume). Verification may cut a
waiting trajectory: a cut inside or before its call drops the call's output when it arrives (`forget_cut`); a
call whose policy tokens are all kept still delivers. What a trajectory has used (turns: its runs of
environment tokens) is read from the response itself, so a checkpoint needs nothing of this module: `settle`
waits for the calls in flight and appends their outputs before one is written, and a restored response that
ends in a call without its output has the call run again (`submittable`), as after a lost server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from rollverify.buffer import RolloutBuffer
from rollverify.environment.runner import RunnerLimits, ToolRunner, TurnResult
from rollverify.environment.tool_calls import TOOL_CALL_CLOSE
from rollverify.environment.tools import ToolRegistry
from rollverify.interfaces import Chunk, RolloutEngine, SamplingParams
from rollverify.sections import ConfigError, bounded
from rollverify.types import ENVIRONMENT, Response

TOOLS_PREFIX = "tools/"  # every statistic of a step's tool turns is logged under this prefix


@dataclass
class ToolsConfig:
    """The `tools` section: the tool turns of a multi-turn task (a task without tools ignores it)."""

    names: list[str] = bounded(factory=list)  # the task's tools the policy may call (empty: all the task offers)
    max_turns: int = bounded(8, ge=1)  # tool calls per trajectory; a call past them ends it
    time_limit_s: float = bounded(10.0, gt=0.0)  # per call (the sandbox's wall limit); then a time-out text
    max_env_tokens: int = bounded(256, ge=16)  # one call's output, truncated with a marker beyond this
    max_concurrent: int = bounded(8, ge=1)  # calls running at once (the runner's pool)
    thinking: bool = True  # Qwen3: false appends the empty think block to each generation prompt

    def check(self) -> None:
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"tools.names: a tool named twice in {self.names}")


class TextCodec(Protocol):
    """The tokenizer, as the tool turns need it."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class _Call:
    future: Future[TurnResult]
    call_end: int  # the response's length at its call's stop token: where the output goes
    started: float


@dataclass
class Delivered:
    """What one `deliver` did: responses continued with their call's output, and those that ended instead."""

    env_tokens: int = 0
    continued: int = 0
    ended: list[Response] = field(default_factory=list)


@dataclass
class TurnStats:
    """A step's tool activity (logged whole under tools/)."""

    calls: int = 0  # calls started
    outputs: int = 0  # outputs appended
    errors: int = 0  # outputs that are an error (malformed, unknown tool, bad arguments, tool error, time-out)
    timeouts: int = 0
    malformed: int = 0
    discarded: int = 0  # outputs dropped because verification cut their call
    ended_by_turns: int = 0  # trajectories that called past max_turns
    ended_by_budget: int = 0  # outputs that left no token of the budget
    env_tokens: int = 0
    tool_seconds: list[float] = field(default_factory=list)


class ToolTurns:
    """The tool turns of one run; the loop owns it (`Loop(tools=...)`)."""

    def __init__(self, cfg: ToolsConfig, registry: ToolRegistry, codec: TextCodec) -> None:
        cfg.check()
        self.cfg, self.codec = cfg, codec
        ids = codec.encode(TOOL_CALL_CLOSE)
        if len(ids) != 1:
            raise ConfigError(
                f"tools: the tokenizer encodes {TOOL_CALL_CLOSE!r} as {len(ids)} tokens {ids}; tool turns stop "
                "generation at that tag, which must be one token (as in Qwen3's vocabulary)"
            )
        self.stop_id = int(ids[0])
        self.runner = ToolRunner(
            registry,
            RunnerLimits(time_limit_s=cfg.time_limit_s, max_env_chars=None, max_env_tokens=cfg.max_env_tokens,
                       max_workers=cfg.max_concurrent),
            count_tokens=lambda text: len(codec.encode(text)),
        )
        self.pending: dict[str, _Call] = {}
        self.stats = TurnStats()
        self.sampling_params: SamplingParams | None = None

    # --- the loop's calls ---------------------------------------------------------------------------------

    def sampling(self, base: SamplingParams) -> SamplingParams:
        """`base` with generation stopping at the tool-call tag too."""
        self.sampling_params = replace(base, stop_token_ids=tuple(dict.fromkeys((*base.stop_token_ids,
                                                                                  self.stop_id))))
        return self.sampling_params

    def is_call(self, chunk: Chunk, response: Response) -> bool:
        """Whether `chunk` ends its response's turn at a tool call that will run (the loop records it
        unfinished and `start`s it); a call past `max_turns` is the trajectory's end instead."""
        if chunk.finish_reason != "stop" or not len(chunk.token_ids) or int(chunk.token_ids[-1]) != self.stop_id:
            return False
        if response.num_env_runs >= self.cfg.max_turns:
            self.stats.ended_by_turns += 1
            return False
        return True

    def start(self, response: Response) -> None:
        """Run the call that ends `response` (its last policy turn) on the runner."""
        rid = response.response_id
        if rid in self.pending:
            raise RuntimeError(f"response {rid} already waits on a tool call")
        env = np.flatnonzero(response.sources == ENVIRONMENT)
        turn = response.token_ids[int(env[-1]) + 1 if len(env) else 0 :]
        text = self.codec.decode(turn.tolist())
        future = self.runner.submit_turn(text, turn_closed=False, thinking=self.cfg.thinking)
        self.pending[rid] = _Call(future, response.num_tokens, time.monotonic())
        self.stats.calls += 1

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' function descriptions, for the chat template's tool list."""
        return self.runner.registry.schemas()

    def waiting(self, response_id: str) -> bool:
        return response_id in self.pending

    def submittable(self, responses: Sequence[Response]) -> list[Response]:
        """Of responses the loop would (re)submit to the engine, those that may generate: one waiting on a call
        stays off the engine, and one that ends in a call without its output (restored from a checkpoint,
        resubmitted after a lost server) has its call run first."""
        out = []
        for r in responses:
            if r.response_id in self.pending:
                continue
            if r.num_tokens and int(r.token_ids[-1]) == self.stop_id and r.sources[-1] != ENVIRONMENT:
                self.start(r)
                continue
            out.append(r)
        return out

    def forget_cut(self, buffer: RolloutBuffer) -> None:
        """After verification's cuts: a call whose policy tokens were cut (or whose response left the buffer)
        will not deliver (its output is discarded when it arrives)."""
        for rid, call in list(self.pending.items()):
            try:
                r = buffer.get(rid)
            except KeyError:
                r = None
            if r is None or r.num_tokens != call.call_end:
                del self.pending[rid]
                self.stats.discarded += 1

    def abandon(self) -> None:
        """Every call in flight will not deliver (the buffer it would append to is replaced: a trainer restart
        restores a checkpoint's, whose responses that end in an unanswered call run it again)."""
        self.stats.discarded += len(self.pending)
        self.pending.clear()

    def deliver(self, buffer: RolloutBuffer, engine: RolloutEngine, wait_s: float = 0.0) -> Delivered:
        """Append every finished call's output to its response and have the engine continue it (resubmitted
        when the engine no longer holds it); `wait_s`: how long to wait for the first to finish."""
        done = self._finished(wait_s)
        out = Delivered()
        if not done:
            return out
        tracked = engine.response_ids()
        appends: dict[str, np.ndarray] = {}
        resubmit = []
        for rid, result in done:
            r = buffer.get(rid)
            self._count(result)
            ids = np.asarray(self.codec.encode(result.text), np.int32)
            if not len(ids) or len(ids) >= r.remaining_budget:  # no room to answer: the trajectory ends at its call
                buffer.record(rid, [], [], [], finish_reason="length")
                self.stats.ended_by_budget += 1
                out.ended.append(r)
                continue
            r.append_environment(ids)
            out.env_tokens += len(ids)
            out.continued += 1
            if rid in tracked:
                appends[rid] = ids
            else:
                resubmit.append(r)
        if appends:
            engine.append(appends)
        if resubmit:
            engine.submit(resubmit, self.sampling_params or SamplingParams())
        self.stats.env_tokens += out.env_tokens
        return out

    def settle(self, buffer: RolloutBuffer, engine: RolloutEngine) -> Delivered:
        """Wait for every call in flight and deliver it (before a checkpoint: its buffer then holds each output,
        and no call is run again after a restore)."""
        total = Delivered()
        while self.pending:
            d = self.deliver(buffer, engine, wait_s=1.0)
            total.env_tokens += d.env_tokens
            total.continued += d.continued
            total.ended += d.ended
        return total

    def step_stats(self, trained: Sequence[Response]) -> dict[str, Any]:
        """The step's tool statistics (and of the trained trajectories: turns, environment share), whole under
        tools/; resets the step's counters."""
        s, self.stats = self.stats, TurnStats()
        return self._stats(s, trained)

    def stat_keys(self) -> list[str]:
        """The keys every `step_stats` has."""
        return list(self._stats(TurnStats(), ()))

    def _stats(self, s: TurnStats, trained: Sequence[Response]) -> dict[str, float]:
        secs = np.asarray(s.tool_seconds, np.float64)
        turns = np.asarray([r.num_env_runs for r in trained], np.float64)
        env = sum(r.num_env_tokens for r in trained)
        total = sum(r.num_tokens for r in trained)
        stats = {
            "calls": s.calls, "outputs": s.outputs, "errors": s.errors, "timeouts": s.timeouts,
            "malformed": s.malformed, "discarded": s.discarded, "ended_by_turns": s.ended_by_turns,
            "ended_by_budget": s.ended_by_budget, "env_tokens": s.env_tokens, "waiting": len(self.pending),
            "tool_s_sum": float(secs.sum()), "tool_s_max": float(secs.max()) if secs.size else 0.0,
            "tool_s_mean": float(secs.mean()) if secs.size else float("nan"),
            "tool_s_p50": float(np.median(secs)) if secs.size else float("nan"),
            "tool_s_p99": float(np.percentile(secs, 99)) if secs.size else float("nan"),
            "turns_mean": float(turns.mean()) if turns.size else float("nan"),
            "turns_p99": float(np.percentile(turns, 99)) if turns.size else float("nan"),
            "turns_max": float(turns.max()) if turns.size else float("nan"),
            "env_token_share": env / total if total else float("nan"),
        }
        return {f"{TOOLS_PREFIX}{k}": float(v) for k, v in stats.items()}

    def generate(self, generate: Callable[..., list[np.ndarray]], prompts: Sequence[np.ndarray],
                 max_new_tokens: int, sampling: SamplingParams, tag: str) -> list[np.ndarray]:
        """Multi-turn completions of fresh prompts outside the training buffer (evaluation), each turn one batch of
        `generate(prompts, max_new_tokens, sampling, tag)` (the engine's `generate`) over prompt + what the
        response holds so far; the calls of a turn run at once. Returns each response's tokens, both sources."""
        stop = replace(sampling, stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, self.stop_id))))
        outs = [np.zeros(0, np.int32) for _ in prompts]
        active = list(range(len(prompts)))
        for turn in range(self.cfg.max_turns + 1):
            if not active:
                break
            room = max(max_new_tokens - len(outs[i]) for i in active)
            got = generate([np.concatenate([prompts[i], outs[i]]) for i in active], room, stop, f"{tag}-t{turn}")
            calls: dict[int, Future[TurnResult]] = {}
            for i, ids in zip(active, got, strict=True):
                start = len(outs[i])
                outs[i] = np.concatenate([outs[i], np.asarray(ids, np.int32)[: max_new_tokens - start]])
                if len(outs[i]) < max_new_tokens and len(ids) and int(ids[-1]) == self.stop_id \
                        and turn < self.cfg.max_turns:
                    text = self.codec.decode(outs[i][start:].tolist())
                    calls[i] = self.runner.submit_turn(text, turn_closed=False, thinking=self.cfg.thinking)
            active = []
            for i, future in calls.items():
                env = np.asarray(self.codec.encode(future.result().text), np.int32)
                if len(env) and len(outs[i]) + len(env) < max_new_tokens:
                    outs[i] = np.concatenate([outs[i], env])
                    active.append(i)
        return outs

    def close(self) -> None:
        self.runner.close(wait=False)

    # --- helpers ------------------------------------------------------------------------------------------

    def _finished(self, wait_s: float) -> list[tuple[str, TurnResult]]:
        if wait_s > 0 and self.pending and not any(c.future.done() for c in self.pending.values()):
            from concurrent.futures import FIRST_COMPLETED, wait

            wait([c.future for c in self.pending.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        done = [(rid, c.future.result()) for rid, c in self.pending.items() if c.future.done()]
        for rid, _ in done:
            del self.pending[rid]
        return done

    def _count(self, result: TurnResult) -> None:
        s = self.stats
        for r in result.results:
            s.outputs += 1
            s.tool_seconds.append(r.seconds)
            s.errors += r.error is not None
            s.timeouts += r.error == "timeout"
            s.malformed += r.error == "malformed"
