"""Admin handlers: stats, weights, health (queries) and shutdown (a command)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

from sglang_ext.dispatch import Handler, Reply
from sglang_ext.protocol import PROTOCOL_VERSION, HealthBody, Message, ShutdownBody, StatsBody, WeightsBody
from sglang_ext.store import State

if TYPE_CHECKING:
    from sglang_ext.server import ControlServer


class AdminHandlers:
    def __init__(self, server: ControlServer):
        self.server = server
        self.records = server.records

    def handlers(self) -> dict[str, Handler]:
        return {"stats": self.stats, "weights": self.weights, "health": self.health, "shutdown": self.shutdown}

    async def stats(self, body: StatsBody, msg: Message) -> Reply:
        """Counts of responses by state and of tokens; SGLang's own loads when `engine` is asked for."""
        recs = self.records
        counts = {s.value: 0 for s in State}
        cached = 0
        for r in recs.table.values():
            counts[r.state.value] += 1
            cached += len(r)
        out = {
            "version": recs.version,
            "paused": recs.paused,
            "live": counts["running"] + counts["paused"],
            "running": counts["running"],
            "paused_responses": counts["paused"],
            "finished": counts["finished"],
            "tokens_generated": recs.tokens_generated,
            "tokens_launched": recs.tokens_launched,
            "tokens_prefix_cached": recs.tokens_prefix_cached,
            "tokens_cached": cached,
            "events_pending": len(recs.events),
            "last_seq": recs.events.last_seq,
            "commands_queued": self.server.dispatcher.queued(),
            "engine_inflight": self.server.engine.inflight(),
            "uptime_s": time.time() - self.server.started,
        }
        if body.engine:
            async with self.server.engine_calls.call():
                out["engine"] = await self.server.engine.loads()
        return out, None, None

    async def weights(self, body: WeightsBody, msg: Message) -> Reply:
        """The served checkpoint's weight names, shapes and dtypes."""
        weights = [
            {"name": n, "shape": list(shape), "dtype": dtype}
            for n, (shape, dtype) in self.server.info.weights.items()
        ]
        return {"weights": weights, "version": self.records.version}, None, None

    async def health(self, body: HealthBody, msg: Message) -> Reply:
        """Answered even while stopping: whether the engine's processes live, and the model's facts."""
        alive = self.server.engine.children_alive()
        stopping = self.server.stopping
        reply = {
            "ok": alive and not stopping,
            "engine_alive": alive,
            "stopping": stopping,
            "version": self.records.version,
            "paused": self.records.paused,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            **self.server.model_info(),
        }
        return reply, None, None

    async def shutdown(self, body: ShutdownBody, msg: Message) -> Reply:
        """Replies first; the server stops right after."""
        asyncio.get_running_loop().call_later(0.01, self.server.request_stop, "shutdown command")
        return {"stopping": True}, None, None
