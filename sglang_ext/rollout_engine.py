"""`SGLangRolloutEngine`: the loop's `RolloutEngine` over one or several control servers.

The loop's `RolloutBuffer` is the controller's one copy of every response. This engine keeps only what routing
needs: which server holds which response id (each slot's `ServerSlot.rids`, the one record of it). It spreads submitted responses over the servers (a GRPO group stays
on one server, so its shared prompt hits the prefix cache), fans pause, truncate, resume, drop and weight updates
out to them, and hands the loop their outputs: each reply's per-token arrays decoded once, each response's
`Chunk` a view into them.

Calls are synchronous; the connections, their event feeds and the processes are a `ServerPool` (one private I/O
thread for the asyncio ZMQ sockets).

Faults. A server is lost when its process exits (a server this engine launched: the watchdog closes its
connection within half a second, so calls in flight fail at once) or when it leaves a request unanswered for
`timeout_s`. A lost server this engine launched is restarted, given the current policy's weights and paused if
the others are; one it did not launch is abandoned. Either way the engine forgets the ids the server held and
`lost()` hands them to the loop, which resubmits the unfinished ones from its buffer: only the tokens generated
since their last pause or finish are generated again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Coroutine, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from rollverify.interfaces import Chunk, SamplingParams
from rollverify.types import Response
from sglang_ext.client import UNAVAILABLE, ControlError, CurveKeys, SubmitRequest
from sglang_ext.pool import ServerAddress, ServerPool, ServerSlot, gather
from sglang_ext.protocol import ENV_VERSION, OutputBatch, WireSamplingParams

log = logging.getLogger(__name__)


def _wire(s: SamplingParams | WireSamplingParams) -> WireSamplingParams:
    """The loop's sampling settings on the wire; the wire's own full set (ignore_eos, seeds) passes as it is."""
    if isinstance(s, WireSamplingParams):
        return s
    return WireSamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop_token_ids=list(s.stop_token_ids) or None
    )


def _request(r: Response) -> SubmitRequest:
    """Prompt plus the kept prefix with what the buffer holds of it (log-probs, versions, routes; environment
    tokens as the wire's ENV_VERSION, their routes, unknown until the engine prefills them, left out)."""
    routes = r.routed_experts if r.num_tokens else None
    if routes is not None and (routes < 0).any():
        routes = None  # the server re-captures every route at the launch
    return SubmitRequest(
        rid=r.response_id,
        prompt_ids=r.prompt_ids,
        max_new_tokens=r.max_new_tokens,
        prefix_ids=r.token_ids,
        prefix_logprobs=r.logprobs if r.num_tokens else None,
        prefix_versions=np.where(r.policy_mask, r.versions, ENV_VERSION) if r.num_tokens else None,
        prefix_routed_experts=routes,
        prompt_routed_experts=r.prompt_routed_experts,
        group=str(r.group_id),
    )


class SGLangRolloutEngine:
    """RolloutEngine over control servers.

    `processes`: the ServerProcess handles of the endpoints this engine launched (same order); `relaunch(i)`
    starts a replacement for server i. A restarted server loads the original checkpoint and gets the current
    policy before it gets any response (`ServedWeights`: `weight_source()`'s buckets through this process, or a
    transport outside it; `restart_weights` sets which once the trainer exists).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        processes: Sequence[Any] = (),
        relaunch: Callable[[int], Any] | None = None,
        weight_source: Callable[[], Iterator[list[tuple[str, Any]]]] | None = None,
        curve: CurveKeys | Sequence[CurveKeys | None] | None = None,
        timeout_s: float = 300.0,
        poll_wait_s: float = 1.0,
    ) -> None:
        self.faults: list[dict[str, Any]] = []  # one record per lost server
        self.last_pause: list[dict] = []  # each server's last pause reply body (timings)
        self._lost: list[str] = []  # ids of lost servers the loop has not collected yet
        self._deferred: list[Chunk] = []  # training outputs that arrived while evaluating
        self.pool = ServerPool(endpoints, processes=processes, relaunch=relaunch, curve=curve, timeout_s=timeout_s,
                               poll_wait_s=poll_wait_s)
        self.weights = ServedWeights(self.pool, weight_source)
        self.paused = any(s.paused for s in self.pool.servers)  # resume() resumes the servers found paused

    # --- RolloutEngine -----------------------------------------------------------------------------------

    def submit(self, responses: Sequence[Response], sampling: SamplingParams | WireSamplingParams) -> None:
        self._check_servers()
        self._submit([_request(r) for r in responses], _wire(sampling))

    def wait_finished(self, timeout: float) -> list[Chunk]:
        chunks, self._deferred = self._deferred, []
        chunks += self._take_events(0.0 if chunks else timeout)
        self._check_servers()
        return chunks

    def pause(self) -> list[Chunk]:
        """Pause every running server; their deltas, and once it returns every response that finished before
        the pause is on the event queue. A server lost meanwhile loses its deltas (`lost()` names its ids)."""
        self._check_servers()
        self.paused = True
        results = self.pool.fan({s: s.conn.pause() for s in self.pool.alive() if not s.paused})
        self.last_pause, chunks, barrier = [], [], []
        t0 = time.perf_counter()
        for s, (batch, body) in self._settle(results).items():
            s.paused = True
            self.last_pause.append(body)
            chunks += _chunks(batch, s)
            barrier.append(s.feed.wait_seq(body["event_seq"]))
        t1 = time.perf_counter()
        self.pool.run(gather(barrier))
        for body in self.last_pause:
            body.update(client_chunks_s=t1 - t0, client_await_events_s=time.perf_counter() - t1)
        return chunks

    def truncate(self, keep: dict[str, int]) -> None:
        self._check_servers()
        plan = self._by_holder(keep)
        self._settle(self.pool.fan({s: s.conn.truncate({rid: int(keep[rid]) for rid in rids})
                                    for s, rids in plan.items()}))

    def append(self, tokens: dict[str, np.ndarray]) -> None:
        """Append environment tokens to held responses and continue them (launched unless paused)."""
        self._check_servers()
        plan = self._by_holder(tokens)
        self._settle(self.pool.fan({s: s.conn.append({rid: tokens[rid] for rid in rids}) for s, rids in plan.items()}))

    def drop(self, response_ids: Iterable[str]) -> None:
        self._check_servers()
        plan: dict[ServerSlot, list[str]] = {}
        for rid in response_ids:
            s = self._holder(rid)
            if s is None:
                self._lost.remove(rid)  # forgotten by the loop before it collected the loss
                continue
            plan.setdefault(s, []).append(rid)
            s.rids.discard(rid)
        self._settle(self.pool.fan({s: s.conn.drop(r) for s, r in plan.items() if s.alive}))

    def resume(self, hold: Collection[str] = ()) -> None:
        self._check_servers()
        if self.paused:
            held = set(hold)
            results = self.pool.fan(
                {s: s.conn.resume(hold=sorted(s.rids & held)) for s in self.pool.alive() if s.paused}
            )
            for s in self._settle(results):
                s.paused = False
            self.paused = False

    def release(self, response_ids: Iterable[str]) -> None:
        """Launch held responses (kept paused by `resume(hold=...)`) on their running servers."""
        self._check_servers()
        self._settle(self.pool.fan({s: s.conn.resume(rids=rids) for s, rids in self._by_holder(response_ids).items()}))

    def update_weights(self, buckets: Iterator[list[tuple[str, Any]]], version: int) -> None:
        self._check_servers()
        try:
            self.weights.push(buckets, version, self.pool.alive())
        except ControlError as e:
            # the bucket stream is spent: after recovery every server gets the whole policy again
            if not (self._check_servers() and self.weights.source is not None):
                raise RuntimeError(f"rollout engine: {e}") from e
            self.weights.push(self.weights.source(), version, self.pool.alive())
        self.weights.version = version
        self.weights.waiting.clear()

    def committed(self, version: int) -> None:
        """`version` is what every live server serves now: a weight transport outside this engine committed it."""
        self.weights.version = version
        self.weights.waiting.clear()

    def awaiting_policy(self) -> set[int]:
        """Restarted servers whose restore was deferred (`DEFERRED`): alive, given no response until the next
        weight push reaches them."""
        return set(self.weights.waiting)

    def restart_weights(self, *, source: Callable[[], Iterator[list[tuple[str, Any]]]] | None = None,
                        restore: Callable[[ServerAddress, int], Any] | None = None) -> None:
        """How a restarted server gets the current policy from now on (see the class docstring): each one given
        replaces the current one. `source` also serves `update_weights` again after a failed push."""
        if source is not None:
            self.weights.source = source
        if restore is not None:
            self.weights.restore = restore

    def live_servers(self) -> list[ServerAddress]:
        """The servers that serve now, in index order."""
        return [s.address() for s in self.pool.alive()]

    def compute_logprobs(self, responses: Sequence[Response]) -> list[np.ndarray | None]:
        """Each response's log-probs under the weights the servers serve now, computed by the server that holds
        it (`compute_logprobs` in docs/protocol.md) while the others generate; None for a response whose server
        was lost."""
        self._check_servers()
        plan = self._by_holder(r.response_id for r in responses)
        results = self._settle(
            self.pool.fan({s: s.conn.compute_logprobs(rids, expect_version=self.weights.version) for s, rids in plan.items()})
        )
        got: dict[str, np.ndarray] = {}
        for s, (lps, _) in results.items():
            got.update(zip(plan[s], lps, strict=True))
        out = [got.get(r.response_id) for r in responses]
        for r, lp in zip(responses, out, strict=True):
            if lp is not None and len(lp) != r.num_tokens:
                raise RuntimeError(
                    f"rollout engine: response {r.response_id} has {r.num_tokens} tokens but its server returned "
                    f"{len(lp)} log-probs"
                )
        return out

    def lost(self) -> list[str]:
        """Ids the engine stopped holding since the last call because their server was lost."""
        ids, self._lost = self._lost, []
        return ids

    def response_ids(self) -> set[str]:
        """Ids on a server, and those of a lost server that `lost()` has not handed out yet."""
        return self._held().union(self._lost)

    @property
    def where(self) -> dict[str, ServerSlot]:
        """Response id -> the slot that holds it (a view of the slots' `rids`)."""
        return {rid: s for s in self.pool.servers for rid in s.rids}

    # --- evaluation, queries and lifecycle ---------------------------------------------------------------

    def generate(self, prompts: Sequence[np.ndarray], max_new_tokens: int, sampling: SamplingParams,
                 tag: str) -> list[np.ndarray]:
        """Complete fresh prompts outside the training buffer (evaluation); returns generated ids each.

        Runs between steps, after the weight update: paused training responses resume now rather than at
        the next rollout phase (same weights either way), and whatever of theirs finishes meanwhile is kept
        for the next `wait_finished`.
        """
        reqs = {f"{tag}-{i}": SubmitRequest(f"{tag}-{i}", p, max_new_tokens) for i, p in enumerate(prompts)}
        wire = _wire(sampling)
        self.resume()
        self._submit(list(reqs.values()), wire)
        got: dict[str, np.ndarray] = {}
        while reqs.keys() - got.keys():
            for c in self._take_events(1.0):
                if c.response_id in reqs:
                    got[c.response_id] = c.token_ids.copy()  # a fresh response's only delta is its whole output
                else:
                    self._deferred.append(c)
            self._check_servers()
            again = [reqs[rid] for rid in self._lost if rid in reqs]
            if again:  # evaluation responses of a lost server: this call still holds their prompts
                self._lost = [rid for rid in self._lost if rid not in reqs]
                self._submit(again, wire)
        self.drop(sorted(reqs))
        return [got[rid] for rid in reqs]

    def reset(self) -> None:
        """Forget whatever the servers hold from an earlier run and leave them generating (not paused).

        The feeds may have delivered finish events of the earlier run's responses before the drops (they poll
        from their start); read after this engine submits the same ids again (a resumed run does), they would
        pass for the new responses' output. A connection's replies arrive in order, so once a drop has
        returned its server's feed has delivered every such event, and the server discarded the rest."""
        for s in self.pool.alive():
            self.pool.run(s.conn.drop(all=True))
            if s.paused:
                self.pool.run(s.conn.resume())
                s.paused = False
        self.paused = False
        self.pool.take_events(0.0)
        self._deferred = []

    def health(self) -> list[dict]:
        return [self._query(s, s.conn.health(timeout_s=10.0)) for s in self.pool.servers]

    def stats(self, engine: bool = False) -> list[dict]:
        return [self._query(s, s.conn.stats(engine)) for s in self.pool.servers]

    def close(self, shutdown: bool = True) -> None:
        """Close the connections (after a shutdown command to each server when `shutdown`) and stop the
        processes this engine launched."""
        self.pool.close(shutdown)

    def __enter__(self) -> SGLangRolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(shutdown=False)

    # --- routing -----------------------------------------------------------------------------------------

    def _settle(self, results: dict[ServerSlot, Any]) -> dict[ServerSlot, Any]:
        """The successful results. A server that failed is recovered if it is lost (its ids go to `lost()`);
        any other failure is raised."""
        failed = {s: r for s, r in results.items() if isinstance(r, BaseException)}
        for s, e in failed.items():
            if not isinstance(e, ControlError):
                raise e
            if e.code == UNAVAILABLE:
                s.alive = False  # no reply within timeout_s, or the watchdog closed its connection
        if failed and not self._check_servers():
            raise RuntimeError(f"rollout engine: {next(iter(failed.values()))}") from next(iter(failed.values()))
        return {s: r for s, r in results.items() if s not in failed}

    def _by_holder(self, rids: Iterable[str]) -> dict[ServerSlot, list[str]]:
        """The ids each server holds, in the order given; those of a lost server the loop has not collected are
        left out (see `_holder`)."""
        plan: dict[ServerSlot, list[str]] = {}
        for rid in rids:
            s = self._holder(rid)
            if s is not None:
                plan.setdefault(s, []).append(rid)
        return plan

    def _holder(self, rid: str) -> ServerSlot | None:
        """The slot that holds `rid`; None when its server was lost and the loop has not collected it yet."""
        for s in self.pool.servers:
            if rid in s.rids:
                return s
        if rid not in self._lost:
            raise KeyError(f"response {rid!r} is not on the rollout engine (never submitted, or dropped)")
        return None

    def _held(self) -> set[str]:
        """Ids some server holds."""
        return set().union(*(s.rids for s in self.pool.servers))

    def _submit(self, reqs: list[SubmitRequest], sampling: WireSamplingParams) -> None:
        """Whole groups to the least-loaded alive server, all-or-nothing per server; what a lost server did
        not take goes to the others."""
        held = self._held()
        dup = [q.rid for q in reqs if q.rid in held]
        if dup:
            raise ValueError(f"response id(s) already on the rollout engine: {dup[:10]}")
        while reqs:
            groups: dict[str, list[SubmitRequest]] = {}
            for q in reqs:
                groups.setdefault(q.group if q.group is not None else f"\0{q.rid}", []).append(q)
            alive = self.pool.alive()
            load = {s: len(s.rids) for s in alive if s.index not in self.weights.waiting}
            if not load:
                raise RuntimeError(f"rollout engine: every live server ({[s.index for s in alive]}) awaits the next "
                                   "weight push (a deferred restore); push the weights first")
            plan: dict[ServerSlot, list[SubmitRequest]] = {}
            for members in groups.values():
                target = min(load, key=lambda s: (load[s], s.index))
                plan.setdefault(target, []).extend(members)
                load[target] += len(members)
            done = self._settle(self.pool.fan({s: s.conn.submit(qs, sampling) for s, qs in plan.items()}))
            for s in done:
                s.rids.update(q.rid for q in plan[s])
            reqs = [q for s, qs in plan.items() if s not in done for q in qs]

    def _take_events(self, timeout: float) -> list[Chunk]:
        return [c for s, batch in self.pool.take_events(timeout) for c in _chunks(batch, s)]

    def _query(self, s: ServerSlot, coro: Coroutine) -> dict:
        if not s.alive:
            coro.close()
            return {"ok": False, "endpoint": s.conn.endpoint, "alive": False}
        try:
            return {"endpoint": s.conn.endpoint, **self.pool.run(coro)}
        except ControlError as e:
            return {"ok": False, "endpoint": s.conn.endpoint, "error": str(e)}

    # --- faults ------------------------------------------------------------------------------------------

    def _check_servers(self) -> bool:
        """Recover every lost server that held responses or can be restarted: its ids go to `lost()`, a
        restarted one gets the current policy and is paused if the others are. True when one was recovered."""
        lost = self.pool.lost()
        for s in lost:
            held = sorted(s.rids)
            s.rids.clear()
            self._lost += held
            new = self.pool.replace(s)
            if new is not None:
                self.weights.bring_up(new)
                if self.paused and not new.paused:
                    self.pool.run(new.conn.pause())
                    new.paused = True
            self.faults.append({"server": s.index, "restarted": new is not None, "lost": held,
                                "version": self.weights.version,
                                "awaits_push": new is not None and new.index in self.weights.waiting})
            log.warning("server %d lost: %s, %d responses to resubmit", s.index,
                        "restarted" if new is not None else "abandoned", len(held))
        return bool(lost)


def _chunks(batch: OutputBatch, s: ServerSlot) -> list[Chunk]:
    """One Chunk per entry that `s` still holds (an event of a dropped response, or of a lost server's slot, is
    not the loop's any more), as views into the batch's arrays."""
    versions = batch.versions.astype(np.int64)
    routes = None if batch.routed_experts is None else batch.routed_experts.astype(np.int32)
    bounds, offsets = batch.bounds.tolist(), batch.offsets.tolist()
    chunks = []
    for i, rid in enumerate(batch.rids):
        if rid not in s.rids:
            continue
        a, b = bounds[i], bounds[i + 1]
        chunks.append(Chunk(rid, batch.token_ids[a:b], batch.logprobs[a:b], versions[a:b],
                            None if routes is None else routes[a:b], batch.finish[i], batch.prompt_routes.get(i),
                            batch.errors.get(i), offsets[i], batch.prefix_routes.get(i)))
    return chunks


DEFERRED = "restore/deferred"  # a restore's statistics key: the server gets the policy at the next push instead


class ServedWeights:
    """The policy the servers serve: its version, pushed to them bucket by bucket, and how a restarted server
    (which loads the original checkpoint) gets it: `restore(server address, version)` when set (a transport
    outside this process), else `source()`'s buckets pushed through this one. A restore whose statistics carry
    `DEFERRED` leaves the server `waiting`: alive, but given no response until the next push (which reaches every
    live server) has brought it the policy."""

    def __init__(self, pool: ServerPool, source: Callable[[], Iterator[list[tuple[str, Any]]]] | None) -> None:
        self.pool = pool
        self.source = source
        self.restore: Callable[[ServerAddress, int], Any] | None = None
        self.version = 0  # the last policy version every live server committed
        self.waiting: set[int] = set()  # restarted servers whose restore the next push completes

    def push(self, buckets: Iterable[Iterable[tuple[str, Any]]], version: int, servers: list[ServerSlot]) -> None:
        """Stream (hf_name, tensor) buckets to `servers`; one bucket of look-ahead marks the last, which commits.
        A server applies nothing unless every bucket it received was valid."""
        it = iter(buckets)
        current = next(it, None)
        if current is None:
            raise ValueError("update_weights needs at least one bucket")
        i = 0
        while current is not None:
            following = next(it, None)
            bucket = list(current)
            commit = following is None
            self.pool.run(gather([s.conn.update_weights(bucket, version, bucket=i, commit=commit) for s in servers]))
            current, i = following, i + 1

    def bring_up(self, server: ServerSlot) -> None:
        """A restarted server gets the current policy (before any response)."""
        if self.restore is not None:
            got = self.restore(server.address(), self.version)
            if isinstance(got, dict) and got.get(DEFERRED):
                self.waiting.add(server.index)
        elif self.source is not None:
            self.push(self.source(), self.version, [server])
