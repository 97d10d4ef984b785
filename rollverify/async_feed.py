"""The driver's side of the asynchronous schedule: keeping the engines fed while the trainer works.

`Feeder` launches new GRPO groups while the engines have room (and the queue of finished groups is short),
records every finished response into the `RolloutBuffer` (whose completed groups are the trainer's queue),
resubmits what a lost server held, and waits for a trainer call (`Pending`) by polling the engines meanwhile:
the trainer's calls run elsewhere (`ThreadCalls`: a worker thread over the trainer, whose ranks are child
processes or Ray actors; the simulator: a second clock), and the driver stays the one thread that touches the
buffer, the ledger and the engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, Protocol

from rollverify.buffer import RolloutBuffer
from rollverify.interfaces import Chunk, RolloutEngine, SamplingParams
from rollverify.types import Group, Response


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


class Feeder:
    """The engines' feed for `rollverify.async_loop.AsyncLoop`; `buffer` and `ledger` are the loop's (it may
    replace them on restore: `attach`)."""

    def __init__(self, engine: RolloutEngine, make_group: Callable[[int], Group],
                 reward: Callable[[Group, Response], float], sampling: SamplingParams, *, n: int, max_live: int,
                 queue_cap: int, wait_s: float, timeout_s: float) -> None:
        self.engine, self.make_group, self.reward, self.sampling = engine, make_group, reward, sampling
        self.n, self.max_live, self.queue_cap, self.wait_s, self.timeout_s = n, max_live, queue_cap, wait_s, timeout_s
        self.buffer = RolloutBuffer()
        self.ledger: Any = None
        self.next_group_id = 0
        self.launching = True  # False: no new group launches (a fallback drains)
        self.longest_chunk = 0  # most tokens one engine output carried since `reset_counts` (decode iterations)
        self.launched_groups = 0
        self.resubmitted = 0
        self._last_progress = time.monotonic()

    def attach(self, buffer: RolloutBuffer, ledger: Any) -> None:
        self.buffer, self.ledger = buffer, ledger

    def reset_counts(self) -> None:
        self.longest_chunk = self.launched_groups = self.resubmitted = 0

    # --- the engines' state -----------------------------------------------------------------------------------

    def held(self, response_id: str) -> Response | None:
        """The buffer's response of this id; None while its group is out of the buffer (taken by a step)."""
        try:
            return self.buffer.get(response_id)
        except KeyError:
            return None

    def num_live(self) -> int:
        """Unfinished buffer responses: every one is on the engines (submitted when launched, revived or
        resubmitted when cut, resubmitted when its server was lost, `submit_missing` after a restore)."""
        done = set(self.buffer.completed)
        return sum(not r.finished for gid, g in self.buffer.groups.items() if gid not in done for r in g.responses)

    def submit_missing(self) -> int:
        """Submit every unfinished buffer response the engines do not hold (after a restore, a switch, a cut of
        a response whose server was lost); returns how many."""
        tracked = self.engine.response_ids()
        missing = [r for r in self.buffer.pending() if r.response_id not in tracked]
        self.submit(missing)
        return len(missing)

    def submit(self, responses: Sequence[Response]) -> None:
        if responses:
            self.engine.submit(responses, self.sampling)

    # --- one round ------------------------------------------------------------------------------------------

    def poll(self) -> bool:
        """Launch groups into the room, record what finished, resubmit what a lost server held. Returns whether
        the engines have anything to generate."""
        self.fill()
        if self.record(self.engine.wait_finished(self.wait_s)):
            self._last_progress = time.monotonic()
        self.resubmit_lost()
        live = self.num_live()
        if live and time.monotonic() - self._last_progress > self.timeout_s:
            raise TimeoutError(f"the engines finished no response for {self.timeout_s:.0f} s ({live} live)")
        return live > 0

    def fill(self) -> int:
        """Launch new groups while the engines have room for one and fewer than `queue_cap` finished groups wait
        for the trainer; returns how many."""
        launched = 0
        if not self.launching or self.buffer.num_finished >= self.queue_cap:
            return 0
        live = self.num_live()
        while live + self.n <= self.max_live:
            group = self.make_group(self.next_group_id)
            self.next_group_id += 1
            self.buffer.add_group(group)
            self.ledger.launched += group.n
            self.submit(group.responses)
            live += group.n
            launched += 1
        self.launched_groups += launched
        return launched

    def resubmit_lost(self) -> int:
        """The unfinished buffer responses a lost server held go to the others (a finished one is kept whole; one
        of a group a step holds is the step's to return)."""
        again = [r for rid in self.engine.lost() if (r := self.held(rid)) is not None and not r.finished]
        self.submit(again)
        self.resubmitted += len(again)
        return len(again)

    def record(self, chunks: Sequence[Chunk]) -> int:
        """Append engine output to the buffer and score responses that finished; returns how many finished."""
        finished = 0
        for c in chunks:
            if c.finish_reason == "error":
                raise RuntimeError(f"the engine failed response {c.response_id}: {c.error}")
            response = self.buffer.get(c.response_id)
            self.buffer.record(
                c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts, finish_reason=c.finish_reason,
                offset=c.offset, prompt_routes=c.prompt_routed_experts, prefix_routes=c.prefix_routed_experts,
            )
            self.ledger.generated_tokens += len(c.token_ids)
            self.longest_chunk = max(self.longest_chunk, len(c.token_ids))
            if response.finished:
                response.reward = float(self.reward(self.buffer.groups[response.group_id], response))
                finished += 1
        return finished

    def await_call(self, pending: Pending) -> Any:
        """The call's result; the engines are fed and drained until it is done."""
        while not pending.done():
            if not self.poll() and not pending.done():
                pending.wait(self.wait_s or 0.01)
        return pending.result()

    def await_finished(self, groups: int) -> None:
        """Poll until at least `groups` finished groups wait in the queue."""
        self._last_progress = time.monotonic()
        while self.buffer.num_finished < groups:
            if not self.poll() and self.buffer.num_finished < groups and not self.launching:
                raise RuntimeError(f"{self.buffer.num_finished} finished groups wait, {groups} needed, and nothing "
                                   "is generating or may launch")
