"""`SGLangRolloutEngine`: the loop's `RolloutEngine` over one or several control servers.

A thin translation between rollverify's data model (`Response`, `Chunk`) and the control client's
(`SubmitRequest`, `Output`). It also owns server faults: a server that stops answering is restarted (when this
object launched it) or abandoned, and the responses it held are resubmitted elsewhere from what the
controller recorded at the last pause or finish, so only tokens generated since then are regenerated.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
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
    """RolloutEngine over `SyncRolloutClient`; `servers` are the ServerProcess handles it may restart."""

    def __init__(
        self, endpoints: Sequence[str], *, servers: Sequence[Any] = (), **client_kwargs: Any
    ) -> None:
        self.client = SyncRolloutClient(list(endpoints), **client_kwargs)
        self.servers = list(servers)
        self.paused = False
        self._held: list[Output] = []  # training outputs that arrived while evaluating

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
        deltas = self._guard(self.client.pause)
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
        self._guard(lambda: self.client.update_weights(buckets, version))

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
            out = self.client.next_finished(600.0)
            if out.rid in want:
                got[out.rid] = np.asarray(self.client.responses[out.rid].token_ids)
            else:
                self._held.append(out)
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
        with contextlib.suppress(Exception):
            if shutdown:
                self.client.shutdown()
            self.client.close()
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop()

    # --- faults ------------------------------------------------------------------------------------------

    def _guard(self, call):
        try:
            return call()
        except ControlError as e:
            if self._check_servers():
                return call()
            raise RuntimeError(f"rollout engine: {e}") from e

    def _check_servers(self) -> bool:
        """Move the responses of servers that stopped answering; True when something was recovered."""
        dead = [s.index for s in self.client.servers if not s.alive and (s.rids or s.live)]
        for i in dead:
            moved = self.client.recover(i)
            log.warning("server %d stopped answering; %d responses resubmitted elsewhere", i, len(moved))
        return bool(dead)
