"""`LoopTrainer`: the loop's `rollverify.interfaces.Trainer` over a MegatronTrainer or a TrainerProxy.

The loop speaks in `Response`s (engine log-probs in `logprobs`, routes split into prompt and per-token parts)
and one advantage per response; the Megatron side takes `TrainSequence`s, and `train_sequence` is the one
conversion between the two. Verification calls `compute_logprobs` (routing per `replay_verify`), training
calls `train_step` (routing per `replay_train`); weights leave in HF-named buckets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from megatron_bridge.batch import TrainSequence
from megatron_bridge.weight_sync import buckets
from rollverify.types import Response


def train_sequence(response: Response, advantage: float | None = None) -> TrainSequence:
    """The trainer's view of `response`: its prompt and tokens of both sources, the engine's log-probs, the
    routes of the [P + G - 1] model inputs (its prompt routes [P - 1] followed by the per-token ones [G],
    environment tokens' included) and, when it holds environment tokens, the loss mask of its policy tokens
    (the trainer recomputes log-probs over the whole sequence and trains the policy tokens only)."""
    routes = response.routed_experts
    if routes is not None and response.prompt_routed_experts is not None:
        routes = np.concatenate([response.prompt_routed_experts, routes])
    mask = response.policy_mask if response.num_env_tokens else None
    return TrainSequence(prompt_ids=response.prompt_ids, gen_ids=response.token_ids, routed_experts=routes,
                         rollout_logprobs=response.logprobs, rollout_versions=response.versions,
                         advantage=advantage, loss_mask=mask)


class LoopTrainer:
    """The loop's trainer, and what the application asks of it besides (export, checkpoints, close)."""

    def __init__(self, trainer: Any, bucket_bytes: int = 64 << 20) -> None:
        self.trainer = trainer
        self.bucket_bytes = bucket_bytes

    def compute_logprobs(self, responses: Sequence[Response], temperature: float) -> list[np.ndarray]:
        if not responses:
            return []
        flat, _ = self.trainer.compute_logprobs([train_sequence(r) for r in responses], temperature=temperature)
        counts = [len(r.token_ids) for r in responses]
        return [a.astype(np.float32) for a in np.split(flat, np.cumsum(counts)[:-1])]

    def old_logprobs(self, responses: Sequence[Response], temperature: float) -> list[np.ndarray]:
        if not responses:
            return []
        flat = self.trainer.old_logprobs([train_sequence(r) for r in responses], temperature=temperature)
        counts = [len(r.token_ids) for r in responses]
        return [a.astype(np.float32) for a in np.split(flat, np.cumsum(counts)[:-1])]

    def train_step(self, responses: Sequence[Response], advantages: np.ndarray, temperature: float,
                   policy_version: int, old_logprobs: Sequence[np.ndarray] | None = None) -> dict:
        adv = np.asarray(advantages, dtype=np.float32).reshape(-1)
        if adv.size != len(responses):
            raise ValueError(f"{adv.size} advantages for {len(responses)} responses (one each)")
        seqs = [train_sequence(r, float(a)) for r, a in zip(responses, adv, strict=True)]
        old = None if old_logprobs is None else np.concatenate([np.asarray(a, np.float32) for a in old_logprobs])
        return self.trainer.train_step(seqs, temperature=temperature, policy_version=policy_version,
                                       old_logprobs=old)

    def export_weights(self) -> Iterator[list[tuple[str, object]]]:
        return buckets(self.trainer.iter_hf_tensors(), self.bucket_bytes)

    def send_weights(self, spec: Any, version: int, bucket_bytes: int | None = None) -> dict[str, float]:
        """The ranks stream the weights to the servers of `spec` (rollverify.app.weight_transport) themselves."""
        return self.trainer.send_weights(spec, version, bucket_bytes or self.bucket_bytes)

    def offload(self, kinds: Sequence[str] = ("params", "grads", "optimizer")) -> dict[str, float]:
        """Every rank releases the device memory of `kinds` until `reload` (the colocated handoff's
        `trainer_memory`, rollverify.app.weight_transport.TransportWeights)."""
        return self.trainer.offload(tuple(kinds))

    def reload(self) -> dict[str, float]:
        """Every rank brings back what `offload` released."""
        return self.trainer.reload()

    def memory_report(self) -> dict[str, int]:
        """The GPU memory CUDA reports on (rank 0 of) the trainer; {} off CUDA."""
        return self.trainer.memory_report()

    def save(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load(self, path: str) -> None:
        self.trainer.load_checkpoint(path)

    def export_hf_state(self, out_dir: str) -> Any:
        """The current policy as a Hugging Face weights folder `out_dir` (`MegatronTrainer.export_hf_state`)."""
        return self.trainer.export_hf_state(out_dir)

    @property
    def ranks(self) -> Any:
        """The rank group of a `TrainerProxy` (None: the trainer runs in this process)."""
        return getattr(self.trainer, "ranks", None)

    def close(self) -> None:
        self.trainer.close()
