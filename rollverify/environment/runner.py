"""A bounded concurrent tool runner: many calls at once while the caller keeps going.

`ToolRunner.submit(call)` returns a future that always resolves, once, to a `ToolResult` (never an exception):
a malformed call, an unknown tool, bad arguments, a tool that raised and a tool that ran past its time limit all
become environment text. `submit_turn(text)` parses a policy turn, submits its calls and resolves to the
environment text that follows the turn (the Qwen3 template's tool-response turn), without holding a pool thread
while it waits.

A call's time limit is enforced twice: the tool's own (the sandbox's wall limit kills the program) and the
runner's deadline, which resolves the future with a time-out result `grace_s` after the limit even when a tool
does not stop; such a tool keeps its pool thread until it returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rollverify.environment.tool_calls import (
    MalformedCall,
    ParsedCall,
    ToolCall,
    parse_tool_calls,
    tool_response_text,
)
from rollverify.environment.tools import ToolOutput, ToolRegistry, truncate_text


@dataclass(frozen=True)
class RunnerLimits:
    """The tool runner's limits (`rollverify.tool_turns.ToolsConfig`, the run's `tools` section, sets them).
    time_limit_s: per call; max_env_chars / max_env_tokens: cap on one call's environment text (marker included;
    tokens as `count_tokens` counts them); max_workers: calls running at once; grace_s: how long past the time
    limit the runner waits for a tool before it resolves the call as timed out."""

    time_limit_s: float = 10.0
    max_env_chars: int | None = 4096
    max_env_tokens: int | None = None
    max_workers: int = 8
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.time_limit_s, bool)
            or not isinstance(self.time_limit_s, int | float)
            or self.time_limit_s <= 0
        ):
            raise ValueError(
                f"RunnerLimits.time_limit_s must be a positive number of seconds; got {self.time_limit_s!r}"
            )
        for name in ("max_env_chars", "max_env_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 16):
                raise ValueError(
                    f"RunnerLimits.{name} must be None or an integer of at least 16; got {value!r}"
                )
        if (
            isinstance(self.max_workers, bool)
            or not isinstance(self.max_workers, int)
            or self.max_workers < 1
        ):
            raise ValueError(f"RunnerLimits.max_workers must be a positive integer; got {self.max_workers!r}")
        if not isinstance(self.grace_s, int | float) or self.grace_s < 0:
            raise ValueError(
                f"RunnerLimits.grace_s must be a non-negative number of seconds; got {self.grace_s!r}"
            )


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome. `text` is the environment text for the call (truncated to the caps); `error` is None,
    "malformed", "unknown_tool", "bad_arguments", "tool_error", "tool_crashed", "timeout" or "closed"; `seconds` runs from
    submit to result (time queued for a pool thread included)."""

    call: ParsedCall
    text: str
    ok: bool
    error: str | None
    seconds: float
    truncated: bool
    output: ToolOutput | None = None


@dataclass(frozen=True)
class TurnResult:
    """The environment text after a policy turn and the results it was made of (empty when the turn had no call)."""

    text: str
    results: tuple[ToolResult, ...]


class ToolRunner:
    """Runs tool calls on a bounded thread pool; use as a context manager or call `close()`."""

    def __init__(
        self,
        registry: ToolRegistry,
        config: RunnerLimits | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.registry = registry
        self.config = config if config is not None else RunnerLimits()
        if self.config.max_env_tokens is not None and count_tokens is None:
            raise ValueError(
                "RunnerLimits.max_env_tokens is set: give ToolRunner a count_tokens (the tokenizer's length)"
            )
        self.count_tokens = count_tokens
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_workers, thread_name_prefix="rv-tool")
        # Calls submitted and not yet resolved: close() resolves them, so no future is left waiting.
        self._unresolved: dict[Future[ToolResult], Callable[[], None]] = {}
        self._unresolved_lock = threading.Lock()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, wait: bool = True) -> None:
        """Stop taking calls; queued calls resolve as closed, running ones finish (`wait`) or resolve as closed."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        with self._unresolved_lock:
            pending = list(self._unresolved.values())
        for resolve_closed in pending:
            resolve_closed()

    def submit(self, call: ParsedCall) -> Future[ToolResult]:
        """A future of the call's result; it resolves exactly once and never with an exception."""
        out: Future[ToolResult] = Future()
        out.set_running_or_notify_cancel()
        lock = threading.Lock()
        start = time.monotonic()

        def deliver(result: ToolResult) -> None:
            with lock:
                if not out.done():
                    out.set_result(result)
            with self._unresolved_lock:
                self._unresolved.pop(out, None)

        if isinstance(call, MalformedCall):
            deliver(
                self._result(call, f"error: malformed tool call: {call.error}", False, "malformed", start)
            )
            return out
        tool = self.registry.get(call.name)
        if tool is None:
            known = ", ".join(self.registry.names()) or "none"
            deliver(
                self._result(
                    call, f"error: unknown tool {call.name!r} (tools: {known})", False, "unknown_tool", start
                )
            )
            return out
        limit = self.config.time_limit_s
        # The deadline runs from the call's start on a pool thread, not from submit: waiting in the queue is not
        # the tool's time.
        timer = threading.Timer(limit + self.config.grace_s, lambda: deliver(self._timeout(call, start)))
        timer.daemon = True

        def work() -> None:
            timer.start()
            try:
                output = tool.run(call.arguments, limit)
            except Exception as exc:  # noqa: BLE001 - a tool's bug is the policy's environment text, not a crash
                result = self._result(
                    call, f"error: tool {call.name!r} failed: {exc!r}", False, "tool_crashed", start
                )
            else:
                result = self._result(call, output.text, output.ok, output.error, start, output)
            finally:
                timer.cancel()
            deliver(result)

        def closed() -> None:
            deliver(self._result(call, "error: the tool runner was closed", False, "closed", start))

        with self._unresolved_lock:
            self._unresolved[out] = closed
        try:
            self._pool.submit(work)
        except RuntimeError:  # the runner is closed
            closed()
        return out

    def submit_turn(self, text: str, *, turn_closed: bool, thinking: bool = True) -> Future[TurnResult]:
        """Parse a policy turn, run its calls concurrently and resolve to the environment text after it."""
        calls = parse_tool_calls(text)
        out: Future[TurnResult] = Future()
        out.set_running_or_notify_cancel()
        if not calls:
            out.set_result(TurnResult(text="", results=()))
            return out
        futures = [self.submit(c) for c in calls]
        remaining = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future[ToolResult]) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            results = tuple(f.result() for f in futures)
            env = tool_response_text([r.text for r in results], turn_closed=turn_closed, thinking=thinking)
            out.set_result(TurnResult(text=env, results=results))

        for f in futures:
            f.add_done_callback(one_done)
        return out

    def run_all(self, calls: Sequence[ParsedCall]) -> list[ToolResult]:
        """Submit every call and wait for all (results in call order)."""
        return [f.result() for f in [self.submit(c) for c in calls]]

    def _timeout(self, call: ToolCall, start: float) -> ToolResult:
        limit = self.config.time_limit_s
        return self._result(
            call, f"error: tool {call.name!r} timed out after {limit:g} s", False, "timeout", start
        )

    def _result(
        self,
        call: ParsedCall,
        text: str,
        ok: bool,
        error: str | None,
        start: float,
        output: ToolOutput | None = None,
    ) -> ToolResult:
        if error == "tool_error" and output is not None and getattr(output.details, "timed_out", False):
            error = "timeout"
        cfg = self.config
        text, cut = truncate_text(text, cfg.max_env_chars, cfg.max_env_tokens, self.count_tokens)
        return ToolResult(
            call=call,
            text=text,
            ok=ok,
            error=error,
            seconds=time.monotonic() - start,
            truncated=cut,
            output=output,
        )
