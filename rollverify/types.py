"""The data model: responses whose generated tokens carry per-token log-probs and policy versions.

A response is generated across several rollout phases (partial rollout): each phase appends tokens under
the current policy version, so its tokens form *segments* of equal version. Per-token fields are numpy
arrays (cheap to ship as raw buffers); ``VerifyBatch`` lays the log-probs and versions of many responses end
to end in torch tensors for verification's vectorised work on CPU or GPU.

Tokens come from two sources (DESIGN.md, "Tokens from two sources"): *policy* tokens, sampled by the engine
(log-prob and version recorded), and *environment* tokens, a tool's output and the template text around it,
inserted by the rollout side (no log-prob: NaN; no version: ``ENV_VERSION``; never trained). ``VerifyBatch``
holds the policy tokens only and maps keep lengths back to whole-response positions: a cut at a policy token
removes everything after it, environment tokens included.

Every per-token field of a response has exactly ``num_tokens`` rows, always: ``append`` checks it and
``truncate`` cuts them all together, in one place, so no cut can leave fields of different lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

FINISH_REASONS = ("stop", "length", "abort")
POLICY, ENVIRONMENT = 0, 1  # values of Response.sources
# The version an environment token records: no policy sampled it. The control channel carries the same value
# (sglang_ext.protocol), where -1 means a submitted token of unknown version; a sampled token's version is >= 0.
ENV_VERSION = -2


def _array(x: Any, dtype: type, name: str, ndim: int = 1) -> np.ndarray:
    a = np.asarray(x, dtype=dtype)
    if a.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {a.shape}")
    return a


@dataclass(eq=False)
class Response:
    """One sampled response of a GRPO group, possibly still being generated.

    Per-token fields (one row per generated token; the prompt is never part of them):
      token_ids      int32   generated token ids
      logprobs       float32 log-prob the engine reported when it sampled the token
      versions       int64   policy version that generated the token
      routed_experts int32   [tokens, layers, top_k] or None: the MoE routes of the forward pass that
                             *produced* each token (sequence position prompt_len + j - 1), i.e. exactly the
                             routes needed to recompute that token's log-prob; cut together with the tokens.
                             An environment token's routes come from the engine's prefill of it.
      sources        uint8   POLICY (sampled) or ENVIRONMENT (inserted: log-prob NaN, version ENV_VERSION)
    ``prompt_routed_experts`` [prompt_len - 1, layers, top_k] holds the routes of the remaining prompt
    positions, so that prompt + response routes cover the trainer's forward pass. Every route is the one of the
    engine's latest forward over its position: when the engine re-prefills the prompt and a kept prefix
    (resuming under new weights), ``reroute`` replaces theirs.
    """

    group_id: int
    index: int
    prompt_ids: np.ndarray
    max_new_tokens: int
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    sources: np.ndarray | None = None  # None: every token is a policy token
    finished: bool = False
    finish_reason: str | None = None
    reward: float | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = _array(self.prompt_ids, np.int32, "prompt_ids")
        self.token_ids = _array(self.token_ids, np.int32, "token_ids")
        self.logprobs = _array(self.logprobs, np.float32, "logprobs")
        self.versions = _array(self.versions, np.int64, "versions")
        if self.sources is None:
            self.sources = np.zeros(len(self.token_ids), np.uint8)
        self.sources = _array(self.sources, np.uint8, "sources")
        if len(self.sources) and int(self.sources.max()) > ENVIRONMENT:
            raise ValueError(f"sources must be {POLICY} (policy) or {ENVIRONMENT} (environment)")
        if self.routed_experts is not None:
            self.routed_experts = _array(self.routed_experts, np.int32, "routed_experts", ndim=3)
        if self.prompt_routed_experts is not None:
            self.prompt_routed_experts = _array(self.prompt_routed_experts, np.int32, "prompt_routed_experts", 3)
        n = len(self.token_ids)
        for name in ("logprobs", "versions", "sources", "routed_experts"):
            a = getattr(self, name)
            if a is not None and len(a) != n:
                raise ValueError(f"{name} must have one row per generated token ({n}), got {len(a)}")
        if self.max_new_tokens < n:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must be >= the tokens generated ({n})")
        if self.finish_reason not in (None, *FINISH_REASONS):
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None, got {self.finish_reason!r}")

    @property
    def response_id(self) -> str:
        return f"{self.group_id}-{self.index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining_budget(self) -> int:
        """Tokens the next rollout may still generate for this response."""
        return self.max_new_tokens - self.num_tokens

    @property
    def policy_mask(self) -> np.ndarray:
        """[num_tokens] bool: True at policy tokens (the ones trained and verified)."""
        return self.sources == POLICY

    @property
    def num_policy_tokens(self) -> int:
        return int(np.count_nonzero(self.sources == POLICY))

    @property
    def num_env_tokens(self) -> int:
        return self.num_tokens - self.num_policy_tokens

    @property
    def num_env_runs(self) -> int:
        """Runs of environment tokens: the tool outputs (turns) the response holds."""
        env = self.sources == ENVIRONMENT
        return int(np.count_nonzero(env[1:] & ~env[:-1]) + (1 if len(env) and env[0] else 0))

    def staleness(self, policy_version: int) -> int:
        """policy_version - min(versions of policy tokens): how many updates the oldest sampled token lags (0
        when it has none)."""
        versions = self.versions[self.sources == POLICY]
        return int(policy_version - versions.min()) if len(versions) else 0

    def append(
        self,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        versions: int | Sequence[int] | np.ndarray,
        routed_experts: np.ndarray | None = None,
        *,
        finish_reason: str | None = None,
        finished: bool | None = None,
        sources: np.ndarray | None = None,
    ) -> None:
        """Add tokens generated in one rollout phase; a scalar version applies to all of them.

        ``finished`` defaults to ``finish_reason in ("stop", "length")``: "abort" or None means paused.
        ``sources`` (default: all policy) marks the environment tokens a chunk carries (a resubmitted prefix).
        """
        if self.finished:
            raise ValueError(f"response {self.response_id} is finished; truncate it before appending")
        tok = _array(token_ids, np.int32, "token_ids")
        lp = _array(logprobs, np.float32, "logprobs")
        if np.ndim(versions) == 0:
            ver = np.full(len(tok), versions, np.int64)
        else:
            ver = _array(versions, np.int64, "versions")
        src = np.zeros(len(tok), np.uint8) if sources is None else _array(sources, np.uint8, "sources")
        if not (len(lp) == len(ver) == len(tok) == len(src)):
            raise ValueError(
                f"append needs one logprob and one version per token: {len(tok)} tokens, "
                f"{len(lp)} logprobs, {len(ver)} versions, {len(src)} sources"
            )
        if len(tok) > self.remaining_budget:
            raise ValueError(f"append of {len(tok)} tokens exceeds the remaining budget {self.remaining_budget}")
        routes = self._joined_routes(routed_experts, len(tok))
        if finish_reason not in (None, *FINISH_REASONS):
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None, got {finish_reason!r}")
        self.token_ids = np.concatenate([self.token_ids, tok])
        self.logprobs = np.concatenate([self.logprobs, lp])
        self.versions = np.concatenate([self.versions, ver])
        self.sources = np.concatenate([self.sources, src])
        self.routed_experts = routes
        self.finish_reason = finish_reason
        self.finished = finish_reason in ("stop", "length") if finished is None else finished

    def append_environment(self, token_ids: Sequence[int] | np.ndarray, routed_experts: np.ndarray | None = None,
                           route_fill: int = -1) -> None:
        """Add environment tokens (a tool's output and the template text around it): log-prob NaN, version
        ENV_VERSION. Their routes are unknown until the engine prefills them (``route_fill`` rows, which the
        engine's next re-prefill replaces through ``reroute``) unless given. The response stays unfinished."""
        tok = _array(token_ids, np.int32, "token_ids")
        n = len(tok)
        if routed_experts is None and self.routed_experts is not None:
            routed_experts = np.full((n, *self.routed_experts.shape[1:]), route_fill, np.int32)
        self.append(tok, np.full(n, np.nan, np.float32), np.full(n, ENV_VERSION, np.int64), routed_experts,
                    finished=False, sources=np.full(n, ENVIRONMENT, np.uint8))

    def _joined_routes(self, routed_experts: np.ndarray | None, n_new: int) -> np.ndarray | None:
        if routed_experts is None:
            if self.routed_experts is not None and n_new:
                raise ValueError("routed_experts missing: this response records routes for every token")
            return self.routed_experts
        new = _array(routed_experts, np.int32, "routed_experts", ndim=3)
        if len(new) != n_new:
            raise ValueError(f"routed_experts must have one row per new token ({n_new}), got {len(new)}")
        if self.routed_experts is None:
            if self.num_tokens:
                raise ValueError("routed_experts given, but this response has tokens without routes")
            return new
        if new.shape[1:] != self.routed_experts.shape[1:]:
            raise ValueError(
                f"routed_experts must be [tokens, {self.routed_experts.shape[1]}, "
                f"{self.routed_experts.shape[2]}], got {list(new.shape)}"
            )
        return np.concatenate([self.routed_experts, new])

    def reroute(self, prompt_routes: np.ndarray | None, prefix_routes: np.ndarray | None = None) -> None:
        """The engine re-prefilled the prompt and the first ``len(prefix_routes)`` tokens: their routes replace
        the recorded ones (the tokens, log-probs and versions stay)."""
        if prompt_routes is not None:
            self.prompt_routed_experts = _array(prompt_routes, np.int32, "prompt_routed_experts", ndim=3)
        if prefix_routes is None:
            return
        new = _array(prefix_routes, np.int32, "prefix_routed_experts", ndim=3)
        if self.routed_experts is None or len(new) > self.num_tokens:
            held = "no routes" if self.routed_experts is None else f"{self.num_tokens} tokens"
            raise ValueError(f"response {self.response_id}: {len(new)} re-prefilled routes, but it holds {held}")
        if new.shape[1:] != self.routed_experts.shape[1:]:
            raise ValueError(f"prefix_routed_experts must be [tokens, {self.routed_experts.shape[1]}, "
                             f"{self.routed_experts.shape[2]}], got {list(new.shape)}")
        self.routed_experts = np.concatenate([new, self.routed_experts[len(new):]])

    def truncate(self, keep_len: int) -> int:
        """Keep the first ``keep_len`` tokens (all per-token fields, the source included); return the tokens cut.

        A response that loses tokens becomes unfinished (it resumes from its prefix with the remaining
        budget) and its reward, computed on the full text, is dropped. Kept tokens keep their log-probs
        and versions.
        """
        keep_len = int(keep_len)
        if not 0 <= keep_len <= self.num_tokens:
            raise ValueError(f"keep_len must be in [0, {self.num_tokens}], got {keep_len}")
        cut = self.num_tokens - keep_len
        if cut:
            self.token_ids = self.token_ids[:keep_len].copy()
            self.logprobs = self.logprobs[:keep_len].copy()
            self.versions = self.versions[:keep_len].copy()
            self.sources = self.sources[:keep_len].copy()
            if self.routed_experts is not None:
                self.routed_experts = self.routed_experts[:keep_len].copy()
            self.finished, self.finish_reason, self.reward = False, None, None
        return cut


@dataclass(eq=False)
class Group:
    """A prompt and its n responses (a GRPO group); finished once all n responses finished."""

    group_id: int
    prompt_ids: np.ndarray
    n: int
    responses: list[Response]
    metadata: dict[str, Any] = field(default_factory=dict)  # label, task name...: JSON-able

    def __post_init__(self) -> None:
        self.prompt_ids = _array(self.prompt_ids, np.int32, "prompt_ids")
        if len(self.responses) != self.n:
            raise ValueError(f"a group needs n={self.n} responses, got {len(self.responses)}")

    @classmethod
    def new(
        cls, group_id: int, prompt_ids: Sequence[int] | np.ndarray, n: int, max_new_tokens: int, **metadata: Any
    ) -> Group:
        """A group with n empty responses, ready to be launched."""
        prompt = _array(prompt_ids, np.int32, "prompt_ids")
        responses = [Response(group_id, i, prompt, max_new_tokens) for i in range(n)]
        return cls(group_id, prompt, n, responses, dict(metadata))

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.responses)

    @property
    def rewards(self) -> np.ndarray:
        """[n] float32 rewards; NaN where a response has none yet."""
        return np.array([np.nan if r.reward is None else r.reward for r in self.responses], np.float32)


@dataclass(eq=False)
class VerifyBatch:
    """What verification reads of many responses, laid end to end: the log-probs and versions of their *policy*
    tokens (flat tensors), per-response policy-token counts, and what maps a keep length among a response's
    policy tokens back to its whole-response length. Token ids and prompts stay in the responses: no strategy
    reads them. A response without environment tokens is the same in both counts."""

    response_ids: list[str]
    logprobs: Tensor  # [N] float32, the engine's, policy tokens only
    versions: Tensor  # [N] int64
    lengths: Tensor  # [R] int64 policy tokens per response, summing to N
    full_lengths: Tensor  # [R] int64 tokens per response, environment tokens included
    positions: Tensor | None = None  # [N] int64 each policy token's index in its response; None: no env tokens
    policy_mask: Tensor | None = None  # [sum full_lengths] bool over the whole responses; None: all policy

    @classmethod
    def from_responses(cls, responses: Sequence[Response], device: str | torch.device = "cpu") -> VerifyBatch:
        def cat(arrays: list[np.ndarray], dtype: type) -> Tensor:
            flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
            return torch.from_numpy(flat).to(device)

        full = torch.tensor([r.num_tokens for r in responses], dtype=torch.int64, device=device)
        if not any(r.num_env_tokens for r in responses):
            return cls([r.response_id for r in responses], cat([r.logprobs for r in responses], np.float32),
                       cat([r.versions for r in responses], np.int64), full, full)
        masks = [r.policy_mask for r in responses]
        return cls(
            response_ids=[r.response_id for r in responses],
            logprobs=cat([r.logprobs[m] for r, m in zip(responses, masks, strict=True)], np.float32),
            versions=cat([r.versions[m] for r, m in zip(responses, masks, strict=True)], np.int64),
            lengths=torch.tensor([int(m.sum()) for m in masks], dtype=torch.int64, device=device),
            full_lengths=full,
            positions=cat([np.flatnonzero(m) for m in masks], np.int64),
            policy_mask=cat(masks, np.bool_),
        )

    @property
    def num_tokens(self) -> int:
        """Policy tokens in the batch."""
        return self.logprobs.shape[0]

    def policy_only(self, per_token: Tensor) -> Tensor:
        """A packed [sum full_lengths] tensor over whole responses, reduced to the policy tokens [N]."""
        return per_token if self.policy_mask is None else per_token[self.policy_mask]

    def full_keep(self, keep: Tensor) -> Tensor:
        """Keep lengths among policy tokens [R] -> whole-response keep lengths: a cut at policy token k removes
        it and everything after it, environment tokens included; keeping every policy token keeps the
        response whole (environment tokens after its last policy token too)."""
        if self.positions is None:
            return keep
        offsets = torch.cumsum(self.lengths, 0) - self.lengths
        at = self.positions[(offsets + keep).clamp(max=max(self.num_tokens - 1, 0))] if self.num_tokens else keep
        return torch.where(keep < self.lengths, at, self.full_lengths)
