"""The two boundaries the loop talks to: a rollout engine and a trainer.

`sglang_ext.rollout_engine.SGLangRolloutEngine` and `megatron_bridge.loop_adapter.LoopTrainer` implement them
for real runs, `rollverify.sim`'s `SimEngine` and `SimTrainer` for the simulator. The loop, the buffer and the
strategies know only these protocols. The backends are imported lazily, inside functions, by the entry points
only: `train` (both; `eval` and `export` start theirs through its `start_engine` / `start_trainer`), `demo`
and `cli` (SGLang), `plan` (Megatron's model description). Every array is numpy, so the same objects cross a
ZMQ frame, a process boundary or a checkpoint without conversion.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rollverify.types import Response


@dataclass
class SamplingParams:
    """What the engine samples with; `temperature` also fixes the log-prob semantics (see docs/protocol.md)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Chunk:
    """Output an engine produced for one response since it was last (re)submitted or paused."""

    response_id: str
    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n], engine's, at sampling time
    versions: np.ndarray  # int64 [n], policy version that sampled each token
    routed_experts: np.ndarray | None  # int32 [n, layers, top_k] for MoE, else None
    finish_reason: str | None  # "stop" | "length" when finished, "error" on failure, None when paused
    # routes of the engine's re-prefill of the prompt (int32 [prompt_len - 1, layers, top_k]) and of the tokens
    # before the chunk ([offset, layers, top_k]), when it ran one: they supersede the routes the buffer holds
    prompt_routed_experts: np.ndarray | None = None
    error: str | None = None
    offset: int | None = None  # where the chunk starts in its response, when the engine knows (the buffer checks)
    prefix_routed_experts: np.ndarray | None = None


class RolloutEngine(Protocol):
    """One or several rollout servers (SGLang, or the simulator's model of them) seen as one pool of capacity."""

    def submit(self, responses: Sequence[Response], sampling: SamplingParams) -> None:
        """Generate each response from prompt + its current tokens, up to its remaining budget."""

    def wait_finished(self, timeout: float) -> list[Chunk]:
        """Block up to `timeout` s for finished responses; returns their output since the last report.
        A finished response stays tracked (truncating it makes it live again) until dropped."""

    def pause(self) -> list[Chunk]:
        """Stop all generation; return the partial output of every live response (finish_reason None)."""

    def truncate(self, keep: dict[str, int]) -> None:
        """Cut the engine's copy of each tracked response to `keep` generated tokens; `resume` relaunches
        the cut ones, finished ones included."""

    def append(self, tokens: dict[str, np.ndarray]) -> None:
        """Append environment tokens (response id -> ids: a tool's output) to tracked responses that are not
        generating (stopped at a tool call, or paused) and continue them from there: at once while the engine
        generates, at `resume` when paused. Their log-probs are none, their routes the engine's prefill of them."""

    def drop(self, response_ids: Iterable[str]) -> None:
        """Forget these responses entirely."""

    def resume(self, hold: Collection[str] = ()) -> None:
        """Resubmit every cached live response from its kept prefix under the current weights, but those in
        `hold`, which stay paused until `release`."""

    def release(self, response_ids: Iterable[str]) -> None:
        """Resubmit held responses (see `resume`) now: the engine is generating."""

    def update_weights(self, buckets: Iterator[list[tuple[str, object]]], version: int) -> None:
        """Load the new policy's HF-named tensors, bucket by bucket; later tokens record `version`."""

    def compute_logprobs(self, responses: Sequence[Response]) -> list[np.ndarray | None]:
        """Log-probs (float32) of each tracked response's tokens (environment ones included) under the current
        weights, in the
        semantics of those it sampled them with (`algo.verify_on: engine`); None for one whose server was lost
        meanwhile. The responses must not be generating (paused or held); the others may."""

    def lost(self) -> list[str]:
        """Ids the engine stopped holding since the last call because their server was lost (what it generated
        since their last report is gone); the loop resubmits the unfinished ones from its buffer."""

    def response_ids(self) -> set[str]:
        """The ids the engine answers for: submitted, and neither dropped nor yet handed out by `lost()` (live,
        paused, held or finished). The engine is the one record of which server holds a response."""

    @property
    def paused(self) -> bool:
        """Whether the engine is paused (`pause` until the next `resume`)."""


class Trainer(Protocol):
    """The policy being trained."""

    def compute_logprobs(self, responses: Sequence[Response], temperature: float) -> list[np.ndarray]:
        """Log-probs of each response's tokens (environment ones included) under the current policy (float32)."""

    def old_logprobs(self, responses: Sequence[Response], temperature: float) -> list[np.ndarray]:
        """The log-probs a `train_step` on these responses would recompute first as its "old" ones (the current
        policy, the step's routing): the asynchronous schedule verifies with them and hands them back to the
        step (`old_logprobs=`), so the pass runs once."""

    def train_step(
        self, responses: Sequence[Response], advantages: np.ndarray, temperature: float, policy_version: int,
        old_logprobs: Sequence[np.ndarray] | None = None,
    ) -> dict:
        """One optimizer step on these responses (one advantage each) from the policy of `policy_version` (tokens
        of that version were sampled by the weights the trainer holds): log-probs over the whole sequence, the
        loss, TIS and its token-mean denominator over policy tokens only; returns metrics. `old_logprobs`: what
        `old_logprobs` returned for them under the weights held now (the step then does not recompute them)."""

    def export_weights(self) -> Iterator[list[tuple[str, object]]]:
        """The current policy in HF naming, in buckets, for the engines."""

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...


class WeightSync(Protocol):
    """How a new policy reaches the engine, and (colocated) how the engine and the trainer take turns on the GPUs.

    `InMemoryWeights` (rollverify.rollout) pushes the trainer's buckets through the driver; on a cluster
    `rollverify.app.weight_transport.TransportWeights` streams them from the trainer's ranks to the servers."""

    def before_training(self) -> None:
        """The rollout phase is over (the engine is paused): the trainer may take the GPU memory."""

    def push(self, version: int) -> dict[str, float]:
        """Every server serves the trainer's current weights as `version` (and, colocated, has its memory back);
        returns the push's statistics (bytes and seconds of the transfer, bytes the trainer released), which the
        loop logs whole under `sync/`."""
