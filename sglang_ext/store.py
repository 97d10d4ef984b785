"""The server's cache of responses: everything each response generated, kept across pause/truncate/resume.

Pure bookkeeping (no engine, no sockets), so its invariants are unit-tested alone: tokens, log-probs, versions
and routed experts of a response always have the same length, truncation cuts them together, and `reported`
marks what the controller already holds, so every generated token is delivered exactly once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from sglang_ext.protocol import Output, SamplingParams


class State(StrEnum):
    PAUSED = "paused"  # live, not generating: waits for resume (or was submitted while paused)
    RUNNING = "running"  # live, an engine request is in flight
    FINISHED = "finished"  # stop, length or error; kept until dropped (a truncation can revive it)


@dataclass
class Record:
    rid: str
    prompt: np.ndarray  # int32 [prompt_len]
    max_new_tokens: int  # budget of the whole response, prefix included
    sampling: SamplingParams
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]; NaN where the controller submitted a prefix without them
    versions: np.ndarray  # int32 [n]; -1 where unknown
    routes: np.ndarray | None = None  # [n, layers, top_k]; the dtype's max value where unknown
    prompt_routes: np.ndarray | None = None  # [prompt_len - 1, layers, top_k], from the first prefill
    state: State = State.PAUSED
    finish_reason: str | None = None
    matched_stop: int | None = None
    error: str | None = None
    reported: int = 0  # tokens[:reported] are already with the controller
    prompt_routes_reported: bool = False
    launches: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)
    launch_len: int = 0  # len(tokens) when the in-flight engine request was launched
    launch_version: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self)

    @property
    def live(self) -> bool:
        return self.state is not State.FINISHED

    def engine_rid(self) -> str:
        """A fresh SGLang request id per launch: a dropped request still draining never collides."""
        self.launches += 1
        return f"{self.rid}#{self.launches}"

    def append(
        self,
        ids: np.ndarray,
        logprobs: np.ndarray,
        version: int,
        routes: np.ndarray | None,
    ) -> None:
        n = len(ids)
        if len(logprobs) != n or (routes is not None and len(routes) != n):
            raise ValueError(f"response {self.rid}: {n} tokens but {len(logprobs)} log-probs")
        self.tokens = np.concatenate([self.tokens, ids.astype(np.int32, copy=False)])
        self.logprobs = np.concatenate([self.logprobs, logprobs.astype(np.float32, copy=False)])
        self.versions = np.concatenate([self.versions, np.full(n, version, dtype=np.int32)])
        if self.routes is not None:
            if routes is None:
                routes = np.full(
                    (n, *self.routes.shape[1:]), np.iinfo(self.routes.dtype).max, self.routes.dtype
                )
            self.routes = np.concatenate([self.routes, routes.astype(self.routes.dtype, copy=False)])

    def truncate(self, keep: int) -> None:
        """Cut to the first `keep` generated tokens; a finished response cut short becomes live again."""
        if not 0 <= keep <= len(self):
            raise ValueError(f"keep {keep} outside [0, {len(self)}]")
        if keep == len(self):
            return
        self.tokens = self.tokens[:keep].copy()
        self.logprobs = self.logprobs[:keep].copy()
        self.versions = self.versions[:keep].copy()
        if self.routes is not None:
            self.routes = self.routes[:keep].copy()
        self.reported = min(self.reported, keep)
        if self.state is State.FINISHED:
            self.state = State.PAUSED
            self.finish_reason = self.matched_stop = self.error = None

    def _slice(self, start: int, with_prompt_routes: bool, seq: int | None = None) -> Output:
        return Output(
            rid=self.rid,
            offset=start,
            token_ids=self.tokens[start:],
            logprobs=self.logprobs[start:],
            versions=self.versions[start:],
            total_len=len(self),
            finish_reason=self.finish_reason if self.state is State.FINISHED else None,
            routed_experts=None if self.routes is None else self.routes[start:],
            prompt_routed_experts=self.prompt_routes if with_prompt_routes else None,
            seq=seq,
            error=self.error,
            matched_stop=self.matched_stop,
        )

    def take_delta(self, seq: int | None = None) -> Output:
        """What the controller has not seen yet; marks it seen."""
        out = self._slice(
            self.reported, not self.prompt_routes_reported and self.prompt_routes is not None, seq
        )
        self.reported = len(self)
        if self.prompt_routes is not None:
            self.prompt_routes_reported = True
        return out

    def snapshot(self) -> Output:
        """The whole cached response (fetch); changes nothing."""
        return self._slice(0, self.prompt_routes is not None)


@dataclass
class RouteShape:
    layers: int
    top_k: int
    dtype: np.dtype


def new_record(
    rid: str,
    prompt: np.ndarray,
    prefix: np.ndarray,
    max_new_tokens: int,
    sampling: SamplingParams,
    route_shape: RouteShape | None,
    prefix_logprobs: np.ndarray | None = None,
    prefix_versions: np.ndarray | None = None,
    prefix_routes: np.ndarray | None = None,
    prompt_routes: np.ndarray | None = None,
) -> Record:
    """A record for a submitted response; the prefix counts as already reported (the controller sent it)."""
    n = len(prefix)
    routes = None
    if route_shape is not None:
        if prefix_routes is not None:
            routes = prefix_routes.astype(route_shape.dtype)
        else:
            fill = np.iinfo(route_shape.dtype).max
            routes = np.full((n, route_shape.layers, route_shape.top_k), fill, dtype=route_shape.dtype)
    return Record(
        rid=rid,
        prompt=np.array(prompt, dtype=np.int32),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        tokens=np.array(prefix, dtype=np.int32),
        logprobs=(
            np.array(prefix_logprobs, dtype=np.float32)
            if prefix_logprobs is not None
            else np.full(n, np.nan, dtype=np.float32)
        ),
        versions=(
            np.array(prefix_versions, dtype=np.int32)
            if prefix_versions is not None
            else np.full(n, -1, dtype=np.int32)
        ),
        routes=routes,
        prompt_routes=None
        if prompt_routes is None or route_shape is None
        else prompt_routes.astype(route_shape.dtype),
        reported=n,
        prompt_routes_reported=prompt_routes is not None,
    )
