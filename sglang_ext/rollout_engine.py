"""`SGLangRolloutEngine`: the loop's `RolloutEngine` over one or several control servers.

A thin translation between rollverify's data model (`Response`, `Chunk`) and the control client's
(`SubmitRequest`, `Output`). It also owns server faults. A server is dead when its process exits (servers this
object launched: a watchdog notices within a second and fails the calls in flight) or when it stops answering
for the client's `timeout_s` (servers someone else runs). A dead server this object launched is restarted,
given the current policy's weights, and paused if the others are; one it did not launch is abandoned. Either
way the unfinished responses it held are resubmitted from what the controller recorded at the last pause or
finish, so only the tokens generated since then are regenerated and the loop's accounting is untouched.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from rollverify.interfaces import Chunk, SamplingParams
from rollverify.types import Response
from sglang_ext.client import ControlError, SubmitRequest, SyncRolloutClient
from sglang_ext.protocol import Output
from sglang_ext.protocol import SamplingParams as WireSampling

log = logging.getLogger(__name__)


def _chunk(out: Output) -> Chunk:
    return Chunk(
        response_id=out.rid,
        token_ids=np.asarray(out.token_ids, np.int32),
        logprobs=np.asarray(out.logprobs, np.float32),
        versions=np.asarray(out.versions, np.int64),
        routed_experts=out.routed_experts,
        finish_reason=out.finish_reason,
        prompt_routed_experts=out.prompt_routed_experts,
        error=out.error,
    )


def _wire(s: SamplingParams) -> WireSampling:
    return WireSampling(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop_token_ids=list(s.stop_token_ids) or None
    )


def _request(r: Response) -> SubmitRequest:
    """Prompt plus the kept prefix with what the controller knows of it (log-probs, versions, routes)."""
    return SubmitRequest(
        rid=r.response_id,
        prompt_ids=r.prompt_ids,
        max_new_tokens=r.max_new_tokens,
        prefix_ids=r.token_ids,
        prefix_logprobs=r.logprobs if r.num_tokens else None,
        prefix_versions=r.versions if r.num_tokens else None,
        prefix_routed_experts=r.routed_experts if r.num_tokens else None,
        prompt_routed_experts=r.prompt_routed_experts,
        group=str(r.group_id),
    )


class SGLangRolloutEngine:
    """RolloutEngine over `SyncRolloutClient`.

    `servers`: the ServerProcess handles of the endpoints this object launched (same order); `relaunch(i)`
    starts a replacement for server i; `weight_source()` yields the current policy's weight buckets, pushed to
    a restarted server (which loads the original checkpoint) before it gets any response.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        servers: Sequence[Any] = (),
        relaunch: Callable[[int], Any] | None = None,
        weight_source: Callable[[], Iterator[list[tuple[str, Any]]]] | None = None,
        **client_kwargs: Any,
    ) -> None:
        self.client = SyncRolloutClient(list(endpoints), **client_kwargs)
        self.servers = list(servers)
        self.relaunch = relaunch
        self.weight_source = weight_source
        self.version = 0  # the last policy version pushed
        self.paused = False
        self.faults: list[dict[str, Any]] = []  # one record per recovered server
        self._unrestartable: set[int] = set()  # launched servers whose restart failed: not tried again
        self._held: list[Output] = []  # training outputs that arrived while evaluating
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the watchdog never judges a slot while it is being restarted
        self._watchdog = threading.Thread(target=self._watch, name="rollout-watchdog", daemon=True)
        if self.servers:
            self._watchdog.start()

    # --- RolloutEngine -----------------------------------------------------------------------------------

    def submit(self, responses: Sequence[Response], sampling: SamplingParams) -> None:
        self._guard(lambda: self.client.submit([_request(r) for r in responses], _wire(sampling)))

    def wait_finished(self, timeout: float) -> list[Chunk]:
        outs, self._held = self._held + self.client.finished_nowait(), []
        if not outs and timeout > 0:
            try:
                outs = [self.client.next_finished(timeout)]
            except TimeoutError:
                outs = []
            outs += self.client.finished_nowait()
        self._check_servers()
        return [_chunk(o) for o in outs]

    def pause(self) -> list[Chunk]:
        deltas = self._guard(self.client.pause)  # a retry pauses the rest and returns every delta
        self.paused = True
        return [_chunk(o) for o in deltas.values()]

    def truncate(self, keep: dict[str, int]) -> None:
        self._guard(lambda: self.client.truncate(keep))

    def drop(self, response_ids: Iterable[str]) -> None:
        self._guard(lambda: self.client.drop(list(response_ids)))

    def resume(self) -> None:
        if self.paused:
            self._guard(self.client.resume)
            self.paused = False

    def update_weights(self, buckets: Iterator[list[tuple[str, Any]]], version: int) -> None:
        self._check_servers()
        try:
            self.client.update_weights(buckets, version)
        except ControlError as e:
            # the bucket stream is spent: after recovery every server gets the whole policy again
            if not (self._check_servers() and self.weight_source is not None):
                raise RuntimeError(f"rollout engine: {e}") from e
            self.client.update_weights(self.weight_source(), version)
        self.version = version

    # --- evaluation and lifecycle ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[np.ndarray], max_new_tokens: int, sampling: SamplingParams,
                 tag: str) -> list[np.ndarray]:
        """Complete fresh prompts outside the training buffer (evaluation); returns generated ids each.

        Runs between steps, after the weight update: paused training responses resume now rather than at
        the next rollout phase (same weights either way), and whatever of theirs finishes meanwhile is kept
        for the next `wait_finished`.
        """
        reqs = [_request(Response(-1, i, p, max_new_tokens)) for i, p in enumerate(prompts)]
        for q in reqs:
            q.rid, q.group = f"{tag}-{q.rid}", None
        self.resume()
        self._guard(lambda: self.client.submit(reqs, _wire(sampling)))
        want = {q.rid for q in reqs}
        got: dict[str, np.ndarray] = {}
        while want - got.keys():
            try:
                outs = [self.client.next_finished(1.0)] + self.client.finished_nowait()
            except TimeoutError:
                outs = []
            for out in outs:
                if out.rid in want:
                    got[out.rid] = np.asarray(self.client.responses[out.rid].token_ids)
                else:
                    self._held.append(out)
            self._check_servers()
        self._guard(lambda: self.client.drop(sorted(want)))
        return [got[q.rid] for q in reqs]

    def reset(self) -> None:
        """Forget whatever the servers hold from an earlier run and leave them generating (not paused)."""
        for st in self.client.servers:
            self.client._run(st.conn.drop(all=True))
            if st.paused:
                self.client._run(st.conn.resume())
                st.paused = False
        self.paused = False

    def close(self, shutdown: bool = True) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            if shutdown:
                self.client.shutdown()
            self.client.close()
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop()

    # --- faults ------------------------------------------------------------------------------------------

    def _guard(self, call):
        self._check_servers()
        try:
            return call()
        except ControlError as e:
            if self._check_servers():
                return call()
            raise RuntimeError(f"rollout engine: {e}") from e

    def _watch(self) -> None:
        """Mark a launched server dead as soon as its process exits: pending calls to it fail at once
        instead of waiting for the client's timeout."""
        while not self._stop.wait(0.5):
            with self._lock:
                for i, sp in enumerate(self.servers):
                    if self.client.servers[i].alive and sp.proc.poll() is not None:
                        log.error("server %d (pid %d) exited with code %s", i, sp.pid, sp.proc.returncode)
                        with contextlib.suppress(Exception):
                            self.client.mark_dead(i)

    def _check_servers(self) -> bool:
        """Recover every dead server that held work (or that can be restarted); True when one was recovered."""
        recovered = False
        for st in self.client.servers:
            i = st.index
            launched = i < len(self.servers)
            if st.alive and launched and self.servers[i].proc.poll() is not None:
                self.client.mark_dead(i)  # exited before the watchdog looked
            restart = launched and self.relaunch is not None and i not in self._unrestartable
            if st.alive or not (restart or st.rids or st.live):
                continue
            moved = self.client.orphans(i)
            if restart:
                try:
                    self._restart(i)
                except Exception as e:
                    if not any(s.alive for s in self.client.servers):
                        raise RuntimeError(f"rollout server {i} died and could not be restarted: {e}") from e
                    log.error("server %d could not be restarted (%s); its responses go to the others", i, e)
                    self._unrestartable.add(i)
                    restart = False
            if moved:
                self.client.submit([tr.as_submit() for tr in moved])
            self.faults.append({"server": i, "restarted": restart, "resubmitted": [tr.rid for tr in moved],
                                "version": self.version})
            log.warning("server %d lost: %s, %d unfinished responses resubmitted", i,
                        "restarted" if restart else "abandoned", len(moved))
            recovered = True
        return recovered

    def _restart(self, i: int) -> None:
        with self._lock:
            with contextlib.suppress(Exception):
                self.servers[i].stop(timeout_s=5.0)  # reap what is left of the old process tree
            self.servers[i] = self.relaunch(i)
            self.client.reconnect(i, self.servers[i].endpoint)
        if self.weight_source is not None:
            self.client.update_weights(self.weight_source(), self.version, servers=[i])
        if self.paused:
            st = self.client.servers[i]
            self.client._run(st.conn.pause())
            st.paused = True
