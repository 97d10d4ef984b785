"""The GPU-time model: how long one decode iteration, one prefill, one optimizer step, one verification
forward and one weight sync take on a cluster, from a model's shape and a GPU's peak figures, and how many
tokens of KV cache one SGLang server holds.

Every duration is a roofline: the larger of bytes moved over the achieved HBM bandwidth and FLOPs over the
achieved peak, plus a fixed per-iteration overhead for decode. The achieved fractions (``bw_eff``, the MFUs)
are the calibration knobs; docs/cost_model.md says how to measure them on a real GPU. Attention counts in
every FLOP figure: causal, per sequence, at that sequence's length.
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
    memory_mib: int  # total memory as the driver reports it (SGLang sizes its pools from this figure)


GPUS = {
    # H100 SXM compute and memory (80 GB: 81,559 MiB as nvidia-smi reports it); NVLink cut, irrelevant here
    "H800": GpuSpec("H800", 989e12, 3.35e12, 81559),
    "H200": GpuSpec("H200", 989e12, 4.8e12, 143771),  # 141 GB
}

# SGLang 0.5.23's scheduler constants (sglang/srt/environ.py, managers/schedule_policy.py): the admission check
# reserves min(max_new_tokens - output, CLIP) future tokens per request, scaled by new_token_ratio for running ones
SGLANG_CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO x schedule_conservativeness (1.0)
SGLANG_MIN_NEW_TOKEN_RATIO = 0.7 * 0.14  # x SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
SGLANG_NEW_TOKEN_RATIO_DECAY = (SGLANG_INIT_NEW_TOKEN_RATIO - SGLANG_MIN_NEW_TOKEN_RATIO) / 600  # per decode step
SGLANG_RETRACT_DECODE_STEPS = 20


def sglang_mem_fraction_static(gpu_memory_mib: float, tp: int) -> float:
    """The `mem_fraction_static` SGLang 0.5.23 picks when the server is given none, for a dense text model without
    DP attention, speculative decoding or post-capture sizing (sglang/srt/arg_groups/memory_hook.py,
    handle_gpu_memory_settings and reserve_for_graph_mb): it reserves 512 MiB + 1.5 MiB per token of the chunked
    prefill + tp/8 GiB + 2 MiB per decode CUDA-graph batch size + 8 MiB per prefill CUDA-graph size, at least
    10 GiB on a GPU of more than 60 GiB, and keeps the rest, rounded to 3 decimals."""
    if gpu_memory_mib < 20 * 1024:
        chunk, decode_bs = 2048, 8
    elif gpu_memory_mib < 35 * 1024:
        chunk, decode_bs = 4096, 48 if tp < 4 else 160
    elif gpu_memory_mib < 60 * 1024:
        chunk, decode_bs = 4096, 32 if tp < 4 else 160
    elif gpu_memory_mib < 160 * 1024:
        chunk, decode_bs = 8192, 256 if tp < 4 else 512
    else:
        chunk, decode_bs = 16384, 512
    # the prefill CUDA graphs (breakable, on by default on CUDA) capture these token counts up to the chunk
    prefill_sizes = [s for s in (*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
                                 *range(1280, 4097, 256), *range(4608, chunk + 1, 512)) if s <= chunk]
    reserved = 512 + max(chunk, 2048) * 1.5 + tp / 8 * 1024 + decode_bs * 2 + len(prefill_sizes) * 8
    if gpu_memory_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder's shape (defaults: Qwen3-8B)."""

    name: str = "Qwen3-8B"
    params: float = 8.19e9
    layers: int = 36
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    bytes_per_param: int = 2  # bf16 weights
    kv_bytes: int = 2  # per element of the KV cache (SGLang's kv_cache_dtype "auto": the model's dtype)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        """What SGLang's pool allocates per token on each GPU of a tp-way server (its cell size: KV heads split over
        tp, one kept per GPU when there are fewer than tp)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * self.kv_bytes

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of attention between one query token and one context token (QK^T and PV, all layers)."""
        return 4 * self.layers * self.q_heads * self.head_dim

    def forward_flops(self, lengths: np.ndarray | float) -> float:
        """One forward over sequences of these lengths: 2N per token plus causal attention within each sequence
        (L (L + 1) / 2 query-key pairs of a sequence of L tokens)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return float(2 * self.params * lengths.sum() + self.attn_flops_per_pair * (lengths * (lengths + 1) / 2).sum())


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
    sync_overhead_s: float = 25.0  # per step: colocated hand-over (offload/onload), rewards
    # --- each server's KV pool, as SGLang sizes it ---
    mem_fraction_static: float | None = None  # None: what SGLang picks for this GPU (sglang_mem_fraction_static)
    max_total_tokens: int | None = None  # SGLang's cap on the pool (None: the profiled size)
    # memory in use on each GPU when a server measures it, before loading its weights: its own CUDA context and
    # the colocated trainer's (1.5 GiB each, rollverify/app/gpu_memory.py PROCESS_OVERHEAD)
    resident_gib: float = 3.0

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"cluster.gpu must be one of {sorted(GPUS)}, got {self.gpu!r}")
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise ValueError(f"cluster.gpus ({self.gpus}) must be a positive multiple of cluster.tp ({self.tp})")
        for key in ("bw_eff", "mfu_decode", "mfu_prefill", "mfu_train"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"cluster.{key} must be in (0, 1], got {getattr(self, key)!r}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"cluster.mem_fraction_static must be in (0, 1) or None, got {self.mem_fraction_static!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"cluster.max_total_tokens must be >= 1 or None, got {self.max_total_tokens!r}")

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
        return self.model.forward_flops(tokens) / self._prefill_flops

    def train(self, lengths: np.ndarray) -> float:
        """One optimizer step over sequences of these lengths (prompt + response each) on the whole cluster: the
        forward and the backward (twice the forward), linear layers and causal attention."""
        return 3 * self.model.forward_flops(lengths) / self._train_flops

    def forward(self, lengths: np.ndarray) -> float:
        """A log-prob forward (the old-log-prob pass, the verification's) over sequences of these lengths on the
        whole cluster."""
        return self.model.forward_flops(lengths) / self._train_flops

    @property
    def mem_fraction_static(self) -> float:
        c = self.cluster
        if c.mem_fraction_static is not None:
            return c.mem_fraction_static
        return sglang_mem_fraction_static(GPUS[c.gpu].memory_mib, c.tp)

    def kv_capacity_tokens(self) -> int:
        """The KV tokens one server holds, as SGLang 0.5.23 computes ``max_total_num_tokens``
        (mem_cache/kv_cache_configurator.py `_profile_available_bytes`, model_executor/pool_configurator.py
        `calculate_pool_sizes`): the free memory after loading the weights less pre * (1 - mem_fraction_static),
        where pre is the free memory before loading them, over the bytes a token takes on each GPU (page size 1).
        Free after loading = pre - weights / tp, so the pool is pre * mem_fraction_static - weights / tp."""
        c, m = self.cluster, self.model
        pre = GPUS[c.gpu].memory_mib * 2**20 - c.resident_gib * 2**30
        rest = pre * self.mem_fraction_static - m.weight_bytes / c.tp
        if rest <= 0:
            raise ValueError(f"the weights ({m.weight_bytes / c.tp / 2**30:.1f} GiB per GPU) leave no memory for the KV "
                             f"cache under mem_fraction_static {self.mem_fraction_static} of {c.gpu}: raise "
                             "cluster.mem_fraction_static or cluster.tp")
        tokens = int(rest // m.kv_bytes_per_token_per_gpu(c.tp))
        return min(tokens, c.max_total_tokens) if c.max_total_tokens is not None else tokens

    def weight_sync(self) -> float:
        """New weights to every server: each GPU receives its shard in parallel."""
        return self.model.weight_bytes / self.cluster.tp / self.cluster.sync_bytes_per_s + self.cluster.sync_overhead_s
