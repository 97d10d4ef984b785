"""Generation handlers: submit, pause, resume, truncate, append, drop (commands) and events, fetch (queries)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from sglang_ext.dispatch import Handler, Reply
from sglang_ext.handlers.submit import (
    build_records,
    check_budgets,
    check_ids_unused,
    check_token_ids,
    read_arrays,
)
from sglang_ext.protocol import (
    AppendBody,
    DropBody,
    ErrorCode,
    EventsBody,
    FetchBody,
    Message,
    PauseBody,
    ProtocolError,
    ResumeBody,
    SubmitBody,
    TruncateBody,
    encode_outputs,
)
from sglang_ext.store import State, pack_deltas

if TYPE_CHECKING:
    from sglang_ext.server import ControlServer


class GenerationHandlers:
    def __init__(self, server: ControlServer):
        self.server = server
        self.records = server.records

    def handlers(self) -> dict[str, Handler]:
        return {
            "submit": self.submit,
            "pause": self.pause,
            "resume": self.resume,
            "truncate": self.truncate,
            "append": self.append,
            "drop": self.drop,
            "events": self.events,
            "fetch": self.fetch,
        }

    async def submit(self, body: SubmitBody, msg: Message) -> Reply:
        """All-or-nothing: every check passes before any record exists; launched at once unless paused."""
        recs = self.records
        recs.require_whole_weights("submit")
        if body.expect_version is not None and body.expect_version != recs.version:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"submit expects weights version {body.expect_version} but the server serves {recs.version}",
            )
        info = self.server.info
        arrays = read_arrays(body, msg, recs.route_shape, info.num_experts)
        check_ids_unused(body.items, recs.table)
        check_token_ids(body, arrays, info.vocab_size)
        check_budgets(body.items, getattr(self.server.engine, "context_len", 0))
        new = build_records(body, arrays, recs.route_shape)
        for rec in new:
            recs.add(rec)
        return {"accepted": len(new), "version": recs.version, "paused": recs.paused}, None, None

    async def pause(self, body: PauseBody, msg: Message) -> Reply:
        """Stop every engine request and reply with each paused response's output since its last report."""
        recs = self.records
        if recs.paused:
            raise ProtocolError(
                ErrorCode.ALREADY_PAUSED, "the server is already paused; resume it first (nothing was changed)"
            )
        recs.paused = True
        running = recs.in_state(State.RUNNING)
        engine_s = await recs.stop_running(running)
        t0 = time.perf_counter()
        out, arrays = pack_deltas([r for r in running if r.state is State.PAUSED], recs.route_shape)
        out.update(
            event_seq=recs.events.last_seq,
            engine_s=engine_s,
            server_s=time.perf_counter() - t0,
            version=recs.version,
        )
        return out, arrays, None

    async def resume(self, body: ResumeBody, msg: Message) -> Reply:
        """Relaunch every paused response under the current weights but those held; with `rids`, launch held
        ones on the running server. All-or-nothing: every check passes before anything launches."""
        recs = self.records
        t0 = time.perf_counter()
        if body.rids is not None:
            if recs.paused:
                raise ProtocolError(
                    ErrorCode.INVALID, "resume with rids launches held responses of a running server, but the "
                    "server is paused: resume it first (nothing was changed)",
                )
            live = recs.lookup(body.rids)
            recs.require_paused(live, "resume rids")
            recs.require_whole_weights("resume")
        else:
            if not recs.paused:
                raise ProtocolError(ErrorCode.NOT_PAUSED, "the server is not paused; nothing to resume")
            recs.require_whole_weights("resume")
            recs.require_paused(recs.lookup(body.hold), "resume hold")
            held = set(body.hold)
            recs.paused = False
            live = [r for r in recs.in_state(State.PAUSED) if r.rid not in held]
        for rec in live:
            recs.launch(rec)
        return {"resumed": len(live), "version": recs.version, "server_s": time.perf_counter() - t0}, None, None

    async def truncate(self, body: TruncateBody, msg: Message) -> Reply:
        """Cut responses that are not generating; a finished one cut short is revived (launched unless paused)."""
        recs = self.records
        targets = recs.lookup(list(body.keep))
        recs.require_not_running(targets, "truncate")
        bad = [(r.rid, body.keep[r.rid], len(r)) for r in targets if not 0 <= body.keep[r.rid] <= len(r)]
        if bad:
            rid, keep, n = bad[0]
            raise ProtocolError(
                ErrorCode.KEEP_OUT_OF_RANGE,
                f"keep length {keep} for response {rid} is outside [0, {n}] ({len(bad)} bad); nothing was changed",
                {"rids": [b[0] for b in bad[:100]]},
            )
        revived = []
        cut = 0
        for rec in targets:
            keep = body.keep[rec.rid]
            cut += len(rec) - keep
            was_finished = rec.state is State.FINISHED
            rec.truncate(keep)
            if was_finished and rec.state is State.PAUSED:
                revived.append(rec.rid)
                if not recs.paused:
                    recs.launch(rec)
        return {"truncated": len(targets), "tokens_cut": cut, "revived": revived}, None, None

    async def append(self, body: AppendBody, msg: Message) -> Reply:
        """Append environment tokens to responses that are not generating (a finished one, stopped at a tool call,
        becomes live) and continue them: launched at once unless the server is paused, `launch` is false, or the
        engine holds a half-loaded version. All-or-nothing: every check passes before anything changes."""
        recs = self.records
        rids = [it.rid for it in body.items]
        if len(set(rids)) != len(rids):
            raise ProtocolError(ErrorCode.INVALID, "append names a response twice; nothing was changed")
        targets = recs.lookup(rids)
        recs.require_not_running(targets, "append")
        ids = msg.array("token_ids", ["int32"], 1)
        counts = [it.count for it in body.items]
        if len(ids) != sum(counts):
            raise ProtocolError(ErrorCode.INVALID, f"token_ids has {len(ids)} ids but the items' counts sum to "
                                f"{sum(counts)}; nothing was changed")
        vocab = self.server.info.vocab_size
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ProtocolError(ErrorCode.INVALID, f"token_ids holds ids outside [0, {vocab}); nothing was changed")
        ctx = getattr(self.server.engine, "context_len", 0)
        for rec, k in zip(targets, counts, strict=True):
            if len(rec) + k >= rec.max_new_tokens or (ctx and len(rec.prompt) + len(rec) + k >= ctx):
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"response {rec.rid}: {k} environment tokens after its {len(rec)} leave no token of its budget "
                    f"{rec.max_new_tokens} (or reach the context length {ctx}) to continue; nothing was changed",
                    {"rids": [rec.rid]},
                )
        if body.launch and not recs.paused:
            recs.require_whole_weights("append")
        offsets = np.cumsum([0, *counts])
        launched = []
        for i, rec in enumerate(targets):
            rec.append_environment(ids[offsets[i] : offsets[i + 1]])
            if body.launch and not recs.paused:
                recs.launch(rec)
                launched.append(rec.rid)
        return {"appended": len(targets), "tokens": int(offsets[-1]), "launched": launched}, None, None

    async def drop(self, body: DropBody, msg: Message) -> Reply:
        recs = self.records
        if body.all == (body.rids is not None):
            raise ProtocolError(ErrorCode.INVALID, "drop needs either rids or all=true")
        targets = list(recs.table.values()) if body.all else recs.lookup(body.rids)
        recs.drop(targets)
        return {"dropped": len(targets)}, None, None

    async def events(self, body: EventsBody, msg: Message) -> Reply:
        """Acknowledge events up to `after`, wait up to `wait_s` for one, reply with the pending ones."""
        events = self.records.events
        events.acknowledge(body.after)
        if not len(events) and body.wait_s > 0 and not self.server.stopping:
            await events.wait(body.wait_s)
        out, arrays = encode_outputs(events.first(body.max_events), seqs=True, route_shape=self.records.route_shape)
        out["last_seq"] = events.last_seq
        return out, arrays, None

    async def fetch(self, body: FetchBody, msg: Message) -> Reply:
        """Whole cached responses (all when no ids are given); changes nothing."""
        recs = self.records
        targets = list(recs.table.values()) if body.rids is None else recs.lookup(body.rids)
        out, arrays = encode_outputs([r.snapshot() for r in targets], route_shape=recs.route_shape)
        out["states"] = [r.state.value for r in targets]
        out["prompt_lens"] = [len(r.prompt) for r in targets]
        out["max_new_tokens"] = [r.max_new_tokens for r in targets]
        return out, arrays, None
