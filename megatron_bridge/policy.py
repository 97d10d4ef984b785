"""`MegatronPolicy`: the loop's `Trainer` over `MegatronTrainer` (in-process) or `SpawnedTrainer` (N ranks).

The loop hands over rollverify `Response`s; the trainer takes them as sequences directly (prompt ids,
generated ids, the engine's log-probs and routes). This adapter adds the per-response advantage, splits the
flat log-prob output back per response, and buckets the HF-named export for the engines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rollverify.types import Response


def _sequence(r: Response, advantage: float | None = None) -> dict[str, Any]:
    """The fields of a Response the trainer reads (a plain dict: it crosses process boundaries)."""
    return {
        "prompt_ids": r.prompt_ids,
        "token_ids": r.token_ids,
        "logprobs": r.logprobs,
        "routed_experts": r.routed_experts,
        "prompt_routed_experts": r.prompt_routed_experts,
        "advantage": advantage,
    }


class MegatronPolicy:
    def __init__(self, trainer: Any, bucket_bytes: int = 64 << 20) -> None:
        self.trainer = trainer
        self.bucket_bytes = bucket_bytes

    def compute_logprobs(self, responses: Sequence[Response], temperature: float) -> list[np.ndarray]:
        flat, _ = self.trainer.compute_logprobs([_sequence(r) for r in responses], temperature=temperature)
        counts = [r.num_tokens for r in responses]
        return np.split(np.asarray(flat, np.float32), np.cumsum(counts)[:-1])

    def train_step(self, responses: Sequence[Response], advantages: np.ndarray, temperature: float) -> dict:
        if abs(temperature - self.trainer.cfg.temperature) > 1e-12:
            raise ValueError(
                f"the trainer computes log-probs at temperature {self.trainer.cfg.temperature}, the rollout "
                f"sampled at {temperature}: set both from one config"
            )
        batch = [_sequence(r, float(a)) for r, a in zip(responses, advantages, strict=True)]
        return self.trainer.train_step(batch)

    def export_weights(self) -> Iterator[list[tuple[str, Any]]]:
        bucket, size = [], 0
        for name, tensor in self.trainer.iter_hf_tensors():
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def save(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load(self, path: str) -> None:
        self.trainer.load_checkpoint(path)
