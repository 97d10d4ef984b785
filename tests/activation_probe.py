"""Bytes one Megatron-Core transformer layer keeps for its backward, counted with
`torch.autograd.graph.saved_tensors_hooks` (each storage once), at a real layer shape on CPU.

A layer's figure is the difference between a 2-layer and a 1-layer model of the same shape (embedding, final
norm and logits cancel). The model is the trainer's own (`megatron_bridge.model.build_model`, bf16, the local
spec) with one stand-in: torch's RMSNorm on CPU is a composite of fp32 ops that keeps fp32 copies of its input,
whereas on CUDA `torch.rms_norm` is the fused kernel (`aten::_fused_rms_norm`, a CUDA-only kernel in torch
2.14.1), which keeps its input and the fp32 reciprocal RMS. `FusedRMSNormSaves` computes the same values and
keeps what the CUDA kernel keeps, so the count is the GPU's.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch


class FusedRMSNormSaves(torch.autograd.Function):
    """RMSNorm keeping (input, weight, fp32 rstd), as CUDA's `_fused_rms_norm` does."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return ((x32 * rstd) * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - the probe counts the forward's saves only
        raise NotImplementedError


@contextlib.contextmanager
def cuda_norm_saves():
    from megatron_bridge.attention import SequenceParallelRMSNorm

    def forward(self, x):
        return FusedRMSNormSaves.apply(x, self.weight, self.eps or torch.finfo(torch.float32).eps)

    old = SequenceParallelRMSNorm.forward
    SequenceParallelRMSNorm.forward = forward
    try:
        yield
    finally:
        SequenceParallelRMSNorm.forward = old


def saved_bytes(arch, layers: int, recompute: str, tokens: int, seed: int = 0) -> int:
    """Bytes autograd keeps (distinct storages, parameters excluded) for one forward of `tokens` tokens."""
    from megatron_bridge.model import PackedSequences, build_model, packed_forward, transformer_config

    a = replace(arch, num_layers=layers, vocab_size=128)
    cfg = transformer_config(a, dtype=torch.bfloat16, routing_replay=False, recompute=recompute)
    model = build_model(a, cfg).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # finite weights; what is saved does not depend on their values (ties route a MoE's
        for p in model.parameters():  # tokens to its first top_k experts: as many copies as any routing)
            p.zero_()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    batch = PackedSequences.pack([torch.randint(0, 128, (tokens,), generator=gen)])
    with cuda_norm_saves(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = packed_forward(model, batch)
    del out
    return sum(seen.values())


def layer_bytes_per_token(arch, recompute: str, tokens: int = 128) -> float:
    """Bytes per token one layer keeps: a 2-layer model's count minus a 1-layer model's, over `tokens`."""
    return (saved_bytes(arch, 2, recompute, tokens) - saved_bytes(arch, 1, recompute, tokens)) / tokens
