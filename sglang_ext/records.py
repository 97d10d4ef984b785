"""The server's responses and their engine requests: launch, absorb, finish, stop, drop.

A record (`store.Record`) is `paused` (live, no engine request), `running` (exactly one engine request in flight,
its task on the record) or `finished` (its final delta queued as an event). Every generated token enters the
record through `_absorb`, stamped with the weights version its request was launched under, and is reported to
the controller exactly once (the record's `reported` mark: a pause reply, a finish event).

`EngineCalls` counts engine calls in flight: SGLang runs at its idle niceness only while none is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

from sglang_ext.protocol import ErrorCode, Output, ProtocolError, route_dtype
from sglang_ext.store import Record, RouteShape, State

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 120.0


class EngineCalls:
    """Engine calls in flight (generation, weights, flush, loads); SGLang is at full priority while any is."""

    def __init__(self, set_idle: Callable[[bool], None] | None):
        self._set_idle = set_idle
        self.busy = 0

    def count(self, delta: int) -> None:
        before, self.busy = self.busy, self.busy + delta
        if self._set_idle is not None and (before == 0) != (self.busy == 0):
            self._set_idle(self.busy == 0)

    @contextlib.asynccontextmanager
    async def call(self) -> AsyncIterator[None]:
        """Around an engine call other than generation."""
        self.count(+1)
        try:
            yield
        finally:
            self.count(-1)


class EventQueue:
    """Finished responses' final deltas, numbered by `seq`, kept until a controller acknowledges them."""

    def __init__(self) -> None:
        self.pending: deque[Output] = deque()
        self.last_seq = 0
        self._waiters: set[asyncio.Future] = set()

    def __len__(self) -> int:
        return len(self.pending)

    def push(self, rec: Record) -> None:
        self.last_seq += 1
        self.pending.append(rec.take_delta(seq=self.last_seq))
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def acknowledge(self, after: int) -> None:
        """Forget every event with seq <= after."""
        while self.pending and self.pending[0].seq <= after:
            self.pending.popleft()

    def discard(self, rids: set[str]) -> None:
        """Forget the pending events of these responses (dropped: no controller is owed them, and one that
        submits the id again must not read the old response's finish as the new one's)."""
        self.pending = deque(e for e in self.pending if e.rid not in rids)

    async def wait(self, timeout_s: float) -> None:
        """Until an event is pushed or `timeout_s` passed."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(fut, timeout_s)
        self._waiters.discard(fut)

    def first(self, n: int) -> list[Output]:
        return [e for _, e in zip(range(n), self.pending, strict=False)]


class Records:
    """Every response the server holds, by id, and the engine requests that generate them."""

    def __init__(
        self,
        engine: Any,
        version: int,
        engine_calls: EngineCalls,
        spawn: Callable[[Awaitable[Any]], asyncio.Task],
    ):
        self.engine = engine
        self.version = version  # the weights version new engine requests are stamped with
        self.blocked: str | None = None  # why no request may launch (the engine holds a half-loaded version)
        self.paused = False
        self.table: dict[str, Record] = {}
        self.events = EventQueue()
        self.tokens_generated = 0
        # input tokens (prompt + kept prefix) of every engine request whose output was recorded, and of those the
        # ones SGLang's prefix cache held (not prefilled)
        self.tokens_launched = 0
        self.tokens_prefix_cached = 0
        self.engine_calls = engine_calls
        self._spawn = spawn
        # one task per dropped response's engine request, aborting it until it has ended (`drop`, `_drain`)
        self.draining: set[asyncio.Task] = set()
        self.route_shape: RouteShape | None = None
        if engine.routes:
            info = engine.info
            self.route_shape = RouteShape(info.num_layers, int(info.top_k), route_dtype(int(info.num_experts)))

    # ------------------------------------------------------------------------------------- queries

    def in_state(self, state: State) -> list[Record]:
        return [r for r in self.table.values() if r.state is state]

    def lookup(self, rids: list[str]) -> list[Record]:
        """The records of `rids`; any unknown id refuses the whole request."""
        missing = [r for r in rids if r not in self.table]
        if missing:
            raise ProtocolError(
                ErrorCode.UNKNOWN_RESPONSE,
                f"unknown response id(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                f"({len(missing)} of {len(rids)}); nothing was changed",
                {"rids": missing[:100]},
            )
        return [self.table[r] for r in rids]

    def require_whole_weights(self, what: str) -> None:
        """Refuse to launch while the engine holds a mix of two weight versions (sglang_ext/handlers/transport.py)."""
        if self.blocked:
            raise ProtocolError(
                ErrorCode.WEIGHTS_INCOMPLETE,
                f"{what}: {self.blocked}; the server reports version {self.version} and launches nothing until a "
                "whole version is loaded (send it again). Nothing was changed",
            )

    def require_not_running(self, targets: list[Record], what: str) -> None:
        """None of `targets` is generating, or RESPONSE_RUNNING naming those that are."""
        running = [r.rid for r in targets if r.state is State.RUNNING]
        if running:
            raise ProtocolError(
                ErrorCode.RESPONSE_RUNNING,
                f"{what} of response(s) {running[:10]} ({len(running)}) while they generate; pause first (or hold "
                "them), nothing was changed",
                {"rids": running[:100]},
            )

    def require_paused(self, targets: list[Record], what: str) -> None:
        """Every one of `targets` is paused (not generating, not finished), or INVALID naming those that are not."""
        bad = [(r.rid, r.state.value) for r in targets if r.state is not State.PAUSED]
        if bad:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"{what} names response(s) that are not paused: {bad[:10]} ({len(bad)}); nothing was changed",
                {"rids": [rid for rid, _ in bad[:100]]},
            )

    async def require_idle(self, what: str) -> None:
        """No response generates and no dropped response's engine request runs: an engine operation (weights,
        memory, flush) meets an engine without requests. Waits for the dropped ones (each `_drain` ends within
        STOP_TIMEOUT_S); BUSY while a held response generates."""
        if self.draining:
            await asyncio.wait(set(self.draining))
        n = len(self.in_state(State.RUNNING))
        if n:
            raise ProtocolError(
                ErrorCode.BUSY, f"{what} needs no generating responses, but {n} are running; pause first"
            )

    # ------------------------------------------------------------------------------------- transitions

    def add(self, rec: Record) -> None:
        """Hold a new response; it launches at once unless the server is paused."""
        self.table[rec.rid] = rec
        if not self.paused:
            self.launch(rec)

    def launch(self, rec: Record) -> None:
        """paused -> running: one engine request from prompt + kept tokens, for the remaining budget."""
        if rec.remaining <= 0:
            self.finish(rec, "length")
            return
        rec.launch_len = n = len(rec)
        rec.launch_version = self.version
        routes_start = None
        if self.route_shape is not None:
            # the positions that will sample new tokens; from 0 (the re-prefilled prompt and prefix too) when
            # the held routes are not all this version's forwards'
            routes_start = 0 if rec.routes_version != self.version else len(rec.prompt) + n - 1
        sampling = dict(rec.sampling_args)
        sampling["max_new_tokens"] = rec.remaining
        input_ids = np.concatenate([rec.prompt, rec.tokens]).tolist()
        self.engine_calls.count(+1)
        rec.task = self._spawn(self._generate(rec, rec.engine_rid(), input_ids, sampling, routes_start))
        rec.state = State.RUNNING

    async def _generate(
        self, rec: Record, erid: str, input_ids: list[int], sampling: dict, routes_start: int | None
    ) -> None:
        try:
            try:
                res = await self.engine.generate(erid, input_ids, sampling, routes_start)
            except Exception as e:
                log.exception("engine request %s failed", erid)
                from sglang_ext.engine import GenResult

                res = GenResult(np.zeros(0, np.int32), np.zeros(0, np.float32), None, "error", error=str(e))
            if self.table.get(rec.rid) is not rec or rec.state is not State.RUNNING:
                return  # dropped meanwhile
            rec.task = None
            try:
                self._absorb(rec, res, routes_start)
            except Exception as e:  # never leave a response running with no engine request behind it
                log.exception("response %s: recording the engine's output failed", rec.rid)
                if rec.state is State.RUNNING:
                    self.finish(rec, "error", f"recording the engine's output failed: {type(e).__name__}: {e}")
        finally:
            self.engine_calls.count(-1)

    def _absorb(self, rec: Record, res: Any, routes_start: int | None) -> None:
        """running -> paused (aborted by a pause) or finished: append what the engine request generated."""
        m = len(res.output_ids)
        self.tokens_launched += len(rec.prompt) + rec.launch_len
        self.tokens_prefix_cached += res.cached_tokens
        rec.append(res.output_ids, res.logprobs, rec.launch_version, self._generated_routes(rec, res, routes_start))
        self.tokens_generated += m
        if res.finish_type == "abort" and self.paused:
            rec.state = State.PAUSED
        elif res.finish_type in ("stop", "length"):
            rec.matched_stop = res.matched_stop
            self.finish(rec, res.finish_type)
        else:
            self.finish(rec, "error", res.error or f"the engine ended the request ({res.finish_type})")

    def _generated_routes(self, rec: Record, res: Any, routes_start: int | None) -> np.ndarray | None:
        """The routes of the generated tokens (None: unknown). A request whose routes start at 0 also re-captured
        the prompt's and the kept prefix's, which replace the held ones once a forward really ran (a token was
        sampled); a request aborted before that leaves them as they were, to be re-captured at the next launch."""
        rs = self.route_shape
        if rs is None or res.routes is None:
            return None
        m = len(res.output_ids)
        routes = res.routes
        if routes_start == 0:
            p, k = len(rec.prompt) - 1, rec.launch_len
            if m == 0 or routes.shape != (p + k + m, rs.layers, rs.top_k):
                if m:
                    log.warning("response %s: %s routes for %d positions; recorded as unknown", rec.rid,
                                routes.shape, p + k + m)
                return None
            rec.reroute(routes[:p], routes[p : p + k], rec.launch_version)
            routes = routes[p + k :]
        if routes.shape == (m, rs.layers, rs.top_k):
            return routes
        log.warning("response %s: %s routes for %d tokens; recorded as unknown", rec.rid, routes.shape, m)
        return None

    def finish(self, rec: Record, reason: str, error: str | None = None) -> None:
        """-> finished: its last delta becomes an event."""
        rec.state = State.FINISHED
        rec.finish_reason = reason
        rec.error = error
        rec.task = None
        self.events.push(rec)

    async def stop_running(self, recs: list[Record]) -> float:
        """Abort every engine request and wait until each has returned its partial output; seconds taken."""
        tasks = [r.task for r in recs if r.task is not None]
        if not tasks:
            return 0.0
        t0 = time.perf_counter()
        self.engine.abort_all()
        _, pending = await asyncio.wait(tasks, timeout=0.05)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise ProtocolError(ErrorCode.ENGINE_ERROR, f"{len(pending)} engine requests did not stop")
            self.engine.abort_all()  # a request still on its way to the scheduler missed the first abort
            _, pending = await asyncio.wait(pending, timeout=0.2)
        return time.perf_counter() - t0

    def drop(self, recs: list[Record]) -> None:
        """Forget responses, their unacknowledged events too; a running one's engine request is aborted in the
        background."""
        self.events.discard({rec.rid for rec in recs})
        for rec in recs:
            if rec.state is State.RUNNING and rec.task is not None:
                drain = self._spawn(self._drain(rec.task, f"{rec.rid}#{rec.launches}"))
                self.draining.add(drain)
                drain.add_done_callback(self.draining.discard)
            del self.table[rec.rid]
            rec.state = State.FINISHED

    async def _drain(self, task: asyncio.Task, erid: str) -> None:
        """Abort a dropped request until it has ended (an abort can overtake a request still on its way)."""
        for _ in range(int(STOP_TIMEOUT_S / 0.2)):
            self.engine.abort(erid)
            await asyncio.wait([task], timeout=0.2)
            if task.done():
                return
        log.warning("dropped request %s did not stop", erid)
