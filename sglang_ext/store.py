"""The server's cache of responses: everything each response generated, kept across pause/truncate/resume.

Pure bookkeeping (no engine, no sockets), so its invariants are unit-tested alone: tokens, log-probs, versions
and routed experts of a response always have the same length, truncation cuts them together, and `reported`
marks what the controller already holds, so every generated token is delivered exactly once.

Each engine request's output is kept as one segment and joined only when needed (a launch, a truncation,
a fetch): the delta a pause or a finish reports is normally the last segment itself, so reporting copies
nothing, and `pack_deltas` concatenates a whole pause's deltas into the reply's arrays in one pass per column.

Routes (MoE) are those of the engine's latest forward over each position: a launch under weights other than
the ones every held route came from (`routes_version`) asks SGLang for the routes of the whole sequence, and
the re-prefilled prompt and prefix routes replace the held ones (`reroute`); the next delta reports them again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from sglang_ext.protocol import ENV_VERSION, UNKNOWN_VERSION, Output, WireSamplingParams, encode_outputs


class State(StrEnum):
    PAUSED = "paused"  # live, not generating: waits for resume (or was submitted while paused)
    RUNNING = "running"  # live, an engine request is in flight
    FINISHED = "finished"  # stop, length or error; kept until dropped (a truncation can revive it)


@dataclass
class RouteShape:
    layers: int
    top_k: int
    dtype: np.dtype


# one segment: (token ids int32, log-probs float32, versions int32, routes [n, L, K] or None)
Segment = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None"]


@dataclass
class Record:
    rid: str
    prompt: np.ndarray  # int32 [prompt_len]
    max_new_tokens: int  # budget of the whole response, prefix included
    sampling: WireSamplingParams
    route_shape: RouteShape | None = None
    sampling_args: dict[str, Any] = field(default_factory=dict)  # SGLang sampling params, shared per submit
    segments: list[Segment] = field(default_factory=list)
    n: int = 0
    prompt_routes: np.ndarray | None = None  # [prompt_len - 1, layers, top_k], from the latest prefill
    # the weights version of the forwards every held route comes from; None: not one version (a submitted
    # prefix's routes, or no routes yet), so the next launch re-captures them all
    routes_version: int | None = None
    state: State = State.PAUSED
    finish_reason: str | None = None
    matched_stop: int | None = None
    error: str | None = None
    reported: int = 0  # tokens[:reported] are already with the controller
    # the prompt's routes and those of tokens[:reported] changed since the controller last got them
    rerouted: bool = False
    launches: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)
    launch_len: int = 0  # len(tokens) when the in-flight engine request was launched
    launch_version: int = 0

    def __len__(self) -> int:
        return self.n

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.n

    @property
    def live(self) -> bool:
        return self.state is not State.FINISHED

    def engine_rid(self) -> str:
        """A fresh SGLang request id per launch: a dropped request still draining never collides."""
        self.launches += 1
        return f"{self.rid}#{self.launches}"

    # per-token columns ---------------------------------------------------------------------------------

    def _joined(self) -> Segment:
        if len(self.segments) != 1:
            self.segments = [_join(self.segments, self.route_shape, 0)]
        return self.segments[0]

    @property
    def tokens(self) -> np.ndarray:
        return self._joined()[0]

    @property
    def logprobs(self) -> np.ndarray:
        return self._joined()[1]

    @property
    def versions(self) -> np.ndarray:
        return self._joined()[2]

    @property
    def routes(self) -> np.ndarray | None:
        return self._joined()[3]

    def _tail(self, start: int) -> Segment:
        """Columns from token `start` on; no copy when that is exactly the last segments' boundary."""
        pos, first = self.n, len(self.segments)
        while first > 0 and pos > start:
            first -= 1
            pos -= len(self.segments[first][0])
        parts = self.segments[first:]
        if pos == start and len(parts) == 1:
            return parts[0]
        return _join(parts, self.route_shape, start - pos)

    def append(self, ids: np.ndarray, logprobs: np.ndarray, version: int, routes: np.ndarray | None) -> None:
        n = len(ids)
        if len(logprobs) != n or (routes is not None and len(routes) != n):
            raise ValueError(f"response {self.rid}: {n} tokens but {len(logprobs)} log-probs")
        if n == 0:
            return
        rs = self.route_shape
        if rs is not None:
            if routes is None:
                routes = np.full((n, rs.layers, rs.top_k), np.iinfo(rs.dtype).max, rs.dtype)
            else:
                routes = routes.astype(rs.dtype, copy=False)
        else:
            routes = None
        self.segments.append(
            (
                ids.astype(np.int32, copy=False),
                logprobs.astype(np.float32, copy=False),
                np.full(n, version, dtype=np.int32),
                routes,
            )
        )
        self.n += n

    def append_environment(self, ids: np.ndarray) -> None:
        """Environment tokens the controller appended (it holds them: they count as reported): log-prob NaN,
        version ENV_VERSION, routes unknown until the next launch, which re-captures every route (a finished
        response becomes paused, ready to continue)."""
        n = len(ids)
        rs = self.route_shape
        routes = None if rs is None else np.full((n, rs.layers, rs.top_k), np.iinfo(rs.dtype).max, rs.dtype)
        self.segments.append((ids.astype(np.int32, copy=True), np.full(n, np.nan, np.float32),
                              np.full(n, ENV_VERSION, np.int32), routes))
        self.n += n
        self.reported = self.n
        self.routes_version = None
        if self.state is State.FINISHED:
            self.state = State.PAUSED
            self.finish_reason = self.matched_stop = self.error = None

    def reroute(self, prompt_routes: np.ndarray, prefix_routes: np.ndarray, version: int) -> None:
        """The engine re-prefilled the prompt and the first len(prefix_routes) tokens under `version`: their
        routes replace the held ones (new arrays: queued events keep views of the old)."""
        k = len(prefix_routes)
        if self.route_shape is None or k > self.n:
            raise ValueError(f"response {self.rid}: {k} re-prefilled routes for {self.n} tokens")
        ids, lps, vers, routes = self._joined()
        self.segments = [(ids, lps, vers, np.concatenate([prefix_routes.astype(self.route_shape.dtype), routes[k:]]))]
        self.prompt_routes = prompt_routes.astype(self.route_shape.dtype)
        self.routes_version = version
        self.rerouted = True

    def truncate(self, keep: int) -> None:
        """Cut to the first `keep` generated tokens; a finished response cut short becomes live again."""
        if not 0 <= keep <= self.n:
            raise ValueError(f"keep {keep} outside [0, {self.n}]")
        if keep == self.n:
            return
        ids, lps, vers, routes = self._joined()
        self.segments = [
            (
                ids[:keep].copy(),
                lps[:keep].copy(),
                vers[:keep].copy(),
                None if routes is None else routes[:keep].copy(),
            )
        ]
        self.n = keep
        self.reported = min(self.reported, keep)
        if self.state is State.FINISHED:
            self.state = State.PAUSED
            self.finish_reason = self.matched_stop = self.error = None

    def _output(self, start: int, with_routes_before: bool, seq: int | None) -> Output:
        """Tokens from `start` on; `with_routes_before`: also the prompt's routes and those of tokens[:start]."""
        ids, lps, vers, routes = self._tail(start)
        prefix_routes = None
        if with_routes_before and start and self.route_shape is not None:
            prefix_routes = self._joined()[3][:start]
        return Output(
            rid=self.rid,
            offset=start,
            token_ids=ids,
            logprobs=lps,
            versions=vers,
            total_len=self.n,
            finish_reason=self.finish_reason if self.state is State.FINISHED else None,
            routed_experts=routes,
            prompt_routed_experts=self.prompt_routes if with_routes_before else None,
            prefix_routed_experts=prefix_routes,
            seq=seq,
            error=self.error,
            matched_stop=self.matched_stop,
        )

    def take_delta(self, seq: int | None = None) -> Output:
        """What the controller has not seen yet (new tokens, and routes that superseded what it holds); marks
        it seen."""
        out = self._output(self.reported, self.rerouted, seq)
        self.reported = self.n
        self.rerouted = False
        return out

    def snapshot(self) -> Output:
        """The whole cached response (fetch); changes nothing."""
        return self._output(0, self.prompt_routes is not None, None)


def pack_deltas(records: list[Record], route_shape: RouteShape | None) -> tuple[dict, dict[str, np.ndarray]]:
    """Every record's output since its last report, marked reported, as one output batch: each delta is a
    view of the record's tail segment (normally its last one, no copy), and `encode_outputs` concatenates them
    once per column; nothing per token runs in Python."""
    return encode_outputs([rec.take_delta() for rec in records], route_shape=route_shape)


def _join(parts: list[Segment], rs: RouteShape | None, skip: int) -> Segment:
    """Concatenate segments (dropping the first `skip` tokens); an empty list gives empty columns."""

    def cat(i: int, dtype) -> np.ndarray:
        arrs = [p[i] for p in parts]
        return np.concatenate(arrs)[skip:] if arrs else np.zeros(0, dtype)

    routes = None
    if rs is not None:
        arrs = [p[3] for p in parts]
        routes = np.concatenate(arrs)[skip:] if arrs else np.zeros((0, rs.layers, rs.top_k), rs.dtype)
    return cat(0, np.int32), cat(1, np.float32), cat(2, np.int32), routes


def new_record(
    rid: str,
    prompt: np.ndarray,
    prefix: np.ndarray,
    max_new_tokens: int,
    sampling: WireSamplingParams,
    route_shape: RouteShape | None,
    prefix_logprobs: np.ndarray | None = None,
    prefix_versions: np.ndarray | None = None,
    prefix_routes: np.ndarray | None = None,
    prompt_routes: np.ndarray | None = None,
    sampling_args: dict[str, Any] | None = None,
) -> Record:
    """A record for a submitted response; the prefix counts as already reported (the controller sent it)."""
    n = len(prefix)
    rec = Record(
        rid=rid,
        prompt=np.array(prompt, dtype=np.int32),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        route_shape=route_shape,
        sampling_args=sampling_args if sampling_args is not None else sampling.model_dump(exclude_none=True),
        prompt_routes=None
        if prompt_routes is None or route_shape is None
        else prompt_routes.astype(route_shape.dtype),
    )
    if n:
        routes = None
        if route_shape is not None:
            routes = (
                np.array(prefix_routes, dtype=route_shape.dtype)
                if prefix_routes is not None
                else np.full(
                    (n, route_shape.layers, route_shape.top_k),
                    np.iinfo(route_shape.dtype).max,
                    route_shape.dtype,
                )
            )
        rec.segments.append(
            (
                np.array(prefix, dtype=np.int32),
                np.array(prefix_logprobs, dtype=np.float32)
                if prefix_logprobs is not None
                else np.full(n, np.nan, np.float32),
                np.array(prefix_versions, dtype=np.int32)
                if prefix_versions is not None
                else np.full(n, UNKNOWN_VERSION, np.int32),
                routes,
            )
        )
        rec.n = n
    rec.reported = n
    return rec
