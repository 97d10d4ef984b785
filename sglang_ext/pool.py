"""The control servers behind one rollout engine, as connections: one private I/O thread, one slot per server.

The asyncio ZMQ sockets of every `ServerConnection` live on the pool's event-loop thread; the engine calls in
from its own thread through `run` and `fan`. Each slot long-polls its server's finish events onto one queue
(`EventFeed`); a watchdog closes the connection of a launched server whose process exited, so calls in flight
to it fail at once; `lost` finds the slots to recover and `replace` restarts a launched one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_ext.client import UNAVAILABLE, ControlError, CurveKeys, ServerConnection
from sglang_ext.protocol import ErrorCode, OutputBatch

log = logging.getLogger(__name__)

EVENTS_PER_POLL = 4096
WATCH_S = 0.5  # how often the watchdog looks at the processes the pool launched


async def gather(coros: Iterable[Coroutine], exceptions: bool = False) -> list:
    return await asyncio.gather(*coros, return_exceptions=exceptions)


class EventFeed:
    """Finished responses of one server, in sequence order, put on the engine's queue (runs on the I/O loop).

    It acknowledges events by polling past them; `last_seq` is what it has delivered, which the pause barrier
    waits for. `gone` means the server stopped answering or is shutting down.
    """

    def __init__(self, server: ServerSlot, sink: queue.SimpleQueue, wait_s: float) -> None:
        self.server, self.sink, self.wait_s = server, sink, wait_s
        self.last_seq = 0
        self.gone = False
        self.failure: BaseException | None = None
        self.cond = asyncio.Condition()
        self.task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        conn = self.server.conn
        try:
            while True:
                try:
                    batch, server_seq = await conn.events(self.last_seq, self.wait_s, EVENTS_PER_POLL)
                except ControlError as e:
                    if e.code not in (UNAVAILABLE, ErrorCode.SHUTTING_DOWN):
                        raise
                    log.error("server %s is gone: %s", conn.endpoint, e)  # crashed, or stopped by someone
                    self.gone = True
                    return
                if len(batch):  # the server re-sends only events after `last_seq`, in order
                    self.sink.put((self.server, batch))
                async with self.cond:
                    if len(batch):
                        self.last_seq = int(batch.seqs[-1])
                    if len(batch) < EVENTS_PER_POLL and server_seq > self.last_seq:
                        # every pending event was in this reply: the rest up to server_seq were acknowledged
                        # before (an earlier connection), so nothing older is still owed to this one
                        self.last_seq = server_seq
                    self.cond.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to whoever waits instead of a silent stall
            log.exception("event delivery from %s failed", conn.endpoint)
            self.failure = e
            self.sink.put((self.server, None))
        finally:
            async with self.cond:
                self.cond.notify_all()

    async def wait_seq(self, seq: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.last_seq >= seq or self.task.done())

    async def stop(self) -> None:
        """Cancel the poll and wait until it has ended. Cancel again until it does: Python 3.11's
        `asyncio.wait_for` can swallow a cancellation that races with a reply."""
        while not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=0.1)


@dataclass(eq=False)
class ServerSlot:
    """One server slot: its connection and event feed, its process when this engine launched it, and the ids
    it holds (live or finished, until dropped). A restart replaces the whole slot."""

    index: int
    conn: ServerConnection
    process: Any | None = None  # a handle with alive(), stop(timeout_s), endpoint: launch.ServerProcess, ray_server.RayServer
    alive: bool = True
    paused: bool = False
    rids: set[str] = field(default_factory=set)
    feed: EventFeed | None = None

    def exited(self) -> bool:
        return self.process is not None and not self.process.alive()

    def address(self) -> ServerAddress:
        return ServerAddress(self.index, self.conn.endpoint, self.conn.curve)


@dataclass(frozen=True)
class ServerAddress:
    """How another process reaches server `index`: its control endpoint and CURVE keys (None: loopback)."""

    index: int
    endpoint: str
    curve: CurveKeys | None


class ServerPool:
    """Slots for `endpoints`; `processes` are the handles of those this pool's owner launched (same order),
    `relaunch(i)` starts a replacement for slot i."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        processes: Sequence[Any] = (),
        relaunch: Callable[[int], Any] | None = None,
        curve: CurveKeys | Sequence[CurveKeys | None] | None = None,
        timeout_s: float = 300.0,
        poll_wait_s: float = 1.0,
    ) -> None:
        self.relaunch, self.timeout_s, self.poll_wait_s = relaunch, timeout_s, poll_wait_s
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # (slot, OutputBatch, or None: its feed failed)
        self.servers: list[ServerSlot] = []
        self._unrestartable: set[int] = set()  # launched servers whose restart failed: not tried again
        self._watchdog = None
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="rollout-io", daemon=True)
        self._io.start()
        curves = list(curve) if isinstance(curve, list | tuple) else [curve] * len(endpoints)
        procs = [*processes, *[None] * (len(endpoints) - len(processes))]
        try:
            for i, (ep, c, p) in enumerate(zip(endpoints, curves, procs, strict=True)):
                self.servers.append(self.run(self._connect(i, ep, c, p)))
        except BaseException:
            self.close(shutdown=False)
            raise
        if any(p is not None for p in procs):
            self._watchdog = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)

    def run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        """Run a coroutine on the I/O thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def fan(self, calls: dict[ServerSlot, Coroutine]) -> dict[ServerSlot, Any]:
        """One call per slot, concurrently; each result, or the exception it raised."""
        return dict(zip(calls, self.run(gather(calls.values(), exceptions=True)), strict=True)) if calls else {}

    def alive(self) -> list[ServerSlot]:
        alive = [s for s in self.servers if s.alive]
        if not alive:
            raise RuntimeError("rollout engine: no rollout server is alive")
        return alive

    def take_events(self, timeout: float) -> list[tuple[ServerSlot, OutputBatch]]:
        """Event batches received so far, waiting up to `timeout` for the first when there is none."""
        batches = []
        while True:
            try:
                s, batch = self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait()
            except queue.Empty:
                return batches
            timeout = 0.0
            if batch is None:
                raise RuntimeError(f"rollout engine: event delivery from {s.conn.endpoint} failed: {s.feed.failure!r}")
            batches.append((s, batch))

    def lost(self) -> list[ServerSlot]:
        """Slots whose server is gone (process exited, events unanswered, a call unanswered) and that still
        matter: they hold responses, or can be restarted. Their connections are closed."""
        out = []
        for s in self.servers:
            if s.alive and (s.exited() or s.feed.gone):
                s.alive = False
            if s.alive or not (s.rids or self._restartable(s)):
                continue
            with contextlib.suppress(Exception):
                self.run(self._disconnect(s), timeout_s=30.0)
            out.append(s)
        return out

    def replace(self, old: ServerSlot) -> ServerSlot | None:
        """A fresh slot for a lost launched server (its process restarted), or None when it cannot be."""
        if not self._restartable(old):
            return None
        try:
            with contextlib.suppress(Exception):
                old.process.stop(timeout_s=5.0)  # reap what is left of the old process tree
            process = self.relaunch(old.index)
            try:
                s = self.run(self._connect(old.index, process.endpoint, old.conn.curve, process))
            except BaseException:
                process.stop()
                raise
        except Exception as e:
            if not any(x.alive for x in self.servers):
                raise RuntimeError(f"rollout server {old.index} died and could not be restarted: {e}") from e
            log.error("server %d could not be restarted (%s); its responses go to the others", old.index, e)
            self._unrestartable.add(old.index)
            return None
        self.servers[old.index] = s
        return s

    def close(self, shutdown: bool = True) -> None:
        """Close every connection (after a shutdown command to each server when `shutdown`), stop the I/O thread
        and the launched processes."""
        if self._loop.is_running():
            if self._watchdog is not None:
                self._watchdog.cancel()
            for s in self.servers:
                with contextlib.suppress(Exception):
                    self.run(self._disconnect(s, shutdown=shutdown and s.alive), timeout_s=60.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._io.join(5)
        for s in self.servers:
            if s.process is not None:
                with contextlib.suppress(Exception):
                    s.process.stop()

    def _restartable(self, s: ServerSlot) -> bool:
        return s.process is not None and self.relaunch is not None and s.index not in self._unrestartable

    async def _connect(self, index: int, endpoint: str, curve: CurveKeys | None, process: Any) -> ServerSlot:
        """A slot for a serving process: connected, its paused state read from its health reply, events fed."""
        conn = await ServerConnection(endpoint, curve=curve, timeout_s=self.timeout_s).start()
        try:
            info = await conn.health(timeout_s=30.0)
        except BaseException:
            await conn.close()
            raise
        s = ServerSlot(index, conn, process, paused=bool(info["paused"]))
        s.feed = EventFeed(s, self.events, self.poll_wait_s)
        return s

    async def _disconnect(self, s: ServerSlot, shutdown: bool = False) -> None:
        await s.feed.stop()
        if shutdown:
            with contextlib.suppress(ControlError):
                await s.conn.shutdown()
        await s.conn.close()

    async def _watch(self) -> None:
        """Close the connection of a launched server as soon as its process exits: calls in flight to it fail
        at once instead of after `timeout_s` (the caller then recovers it)."""
        while True:
            await asyncio.sleep(WATCH_S)
            for s in self.servers:
                if s.alive and s.conn.sock is not None and s.exited():
                    log.error("server %d (%s) exited", s.index, s.process)
                    await s.conn.close()
