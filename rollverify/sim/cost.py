"""The GPU-time model: how long one decode iteration, one prefill, one optimizer step, one verification
forward and one weight sync take on a cluster, from a model's shape and a GPU's peak figures.

Every duration is a roofline: the larger of bytes moved over the achieved HBM bandwidth and FLOPs over the
achieved peak, plus a fixed per-iteration overhead for decode. The achieved fractions (``bw_eff``, the MFUs)
are the calibration knobs; docs/cost_model.md says how to measure them on a real GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GpuSpec:
    """Peak dense bf16 FLOP/s and HBM bandwidth of one GPU (vendor figures)."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float


GPUS = {
    "H800": GpuSpec("H800", 989e12, 3.35e12),  # H100 SXM compute and memory; NVLink cut, irrelevant here
    "H200": GpuSpec("H200", 989e12, 4.8e12),
}


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder's shape (defaults: Qwen3-8B)."""

    name: str = "Qwen3-8B"
    params: float = 8.19e9
    layers: int = 36
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    bytes_per_param: int = 2  # bf16 weights and KV cache

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of attention between one query token and one context token (QK^T and PV, all layers)."""
        return 4 * self.layers * self.q_heads * self.head_dim


@dataclass(frozen=True)
class ClusterSpec:
    """The colocated cluster: every GPU serves rollouts, then trains (the paper's setting: 32 H800)."""

    gpu: str = "H800"
    gpus: int = 32
    tp: int = 1  # GPUs per rollout server; servers = gpus / tp
    bw_eff: float = 0.75  # achieved / peak HBM bandwidth in decode
    decode_overhead_s: float = 0.002  # per decode iteration: scheduling, sampling, launches
    mfu_decode: float = 0.5  # achieved / peak FLOP/s when a decode iteration is compute-bound
    mfu_prefill: float = 0.45
    mfu_train: float = 0.25  # training and the verification forward (FSDP-class, long packed sequences)
    sync_bytes_per_s: float = 20e9  # trainer -> engines weight transfer (colocated, per GPU, in parallel)
    sync_overhead_s: float = 25.0  # per step: colocated hand-over (offload/onload), rewards, old log-probs

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"cluster.gpu must be one of {sorted(GPUS)}, got {self.gpu!r}")
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise ValueError(f"cluster.gpus ({self.gpus}) must be a positive multiple of cluster.tp ({self.tp})")
        for key in ("bw_eff", "mfu_decode", "mfu_prefill", "mfu_train"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"cluster.{key} must be in (0, 1], got {getattr(self, key)!r}")

    @property
    def servers(self) -> int:
        return self.gpus // self.tp


class CostModel:
    """Durations in seconds for one model on one cluster."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        self.model, self.cluster = model, cluster
        gpu = GPUS[cluster.gpu]
        tp = cluster.tp
        self._bw = gpu.hbm_bytes_per_s * cluster.bw_eff * tp  # one server's achieved bandwidth
        self._decode_flops = gpu.peak_flops * cluster.mfu_decode * tp
        self._prefill_flops = gpu.peak_flops * cluster.mfu_prefill * tp
        self._train_flops = gpu.peak_flops * cluster.mfu_train * cluster.gpus

    def decode_iteration(self, batch: np.ndarray | float, context_tokens: np.ndarray | float) -> np.ndarray | float:
        """One decode iteration of a server running ``batch`` sequences holding ``context_tokens`` in all:
        the weights and every sequence's KV are read once (memory-bound), or the matmuls and attention
        dominate (compute-bound). Elementwise on arrays (one entry per server)."""
        m = self.model
        memory = (m.weight_bytes + m.kv_bytes_per_token * context_tokens) / self._bw
        compute = (2 * m.params * batch + m.attn_flops_per_pair * context_tokens) / self._decode_flops
        return np.maximum(memory, compute) + self.cluster.decode_overhead_s

    def prefill(self, tokens: float) -> float:
        """Prefill of one sequence of ``tokens`` (prompt + kept response) on one server: compute-bound."""
        m = self.model
        flops = 2 * m.params * tokens + m.attn_flops_per_pair * tokens * tokens / 2
        return flops / self._prefill_flops

    def train(self, tokens: float) -> float:
        """One optimizer step over ``tokens`` (prompts + responses) on the whole cluster: 6 N per token."""
        return 6 * self.model.params * tokens / self._train_flops

    def forward(self, tokens: float) -> float:
        """A log-prob forward (the verification's) over ``tokens`` on the whole cluster: 2 N per token."""
        return 2 * self.model.params * tokens / self._train_flops

    def weight_sync(self) -> float:
        """New weights to every server: each GPU receives its shard in parallel."""
        return self.model.weight_bytes / self.cluster.tp / self.cluster.sync_bytes_per_s + self.cluster.sync_overhead_s
