"""The trainer's GPU throughput paths, each chosen once at start from the device and what is importable, and
logged once per process:

* layer spec: Transformer Engine's (`get_gpt_layer_with_transformer_engine_spec`: layer norms fused into the
  following linear layers, fused RoPE, fused bias-SwiGLU) when TE imports on CUDA, else Megatron-Core's local
  spec with the project's norms (`megatron_bridge.model.build_model`);
* grouped GEMM for MoE experts (`moe_grouped_gemm`, TE's `TEGroupedMLP`: a layer's local experts in one grouped
  matrix multiply instead of one call per expert) with the TE spec on an MoE model;
* overlapped gradient reduce(-scatter) with the backward (Megatron-Core DDP `overlap_grad_reduce`) on CUDA. The
  parameter all-gather stays in the optimizer step (`overlap_param_gather` off): overlapping it defers the
  gather to the next forward's pre-hooks, but here the weight push, a checkpoint or an offload reads the
  parameters right after the step, before any forward, and would read stale shards;
* the packed-attention kernel (`megatron_bridge.attention.PackedCoreAttention`): flash-attn 2's
  `flash_attn.flash_attn_varlen_func`, else flash-attn 4's `flash_attn.cute.flash_attn_varlen_func` (what
  sglang 0.5.23's GPU install brings: the `flash-attn-4` wheel ships only the `flash_attn/cute` package, so the
  top-level import fails there), else torch's SDPA per sequence. CPU always takes the local spec, no overlap
  and SDPA.

`probe()` reads the environment; `select_paths` is a pure function of it, so every branch is tested on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

Attention = Literal["flash_attn_2", "flash_attn_4", "sdpa"]


@dataclass(frozen=True)
class Probe:
    """What this process can use: a CUDA device, Transformer Engine (and its grouped linear layer), and which
    flash-attention varlen entry point imports."""

    cuda: bool
    transformer_engine: bool = False
    te_grouped_linear: bool = False
    flash_attn_2: bool = False
    flash_attn_4: bool = False
    errors: dict[str, str] = field(default_factory=dict)


def _imports(module: str, attr: str | None, errors: dict[str, str]) -> bool:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        mod = importlib.import_module(module)
        if attr is not None:
            getattr(mod, attr)
        return True
    except Exception as e:  # noqa: BLE001 - installed but built for another torch / CUDA, or without a GPU
        errors[module] = f"{type(e).__name__}: {e}"
        return False


def probe(device: str) -> Probe:
    """This process's `Probe` for a trainer on `device` ("cuda" or "cpu"); imports are tried only on CUDA."""
    if device != "cuda":
        return Probe(cuda=False)
    errors: dict[str, str] = {}
    te = _imports("transformer_engine.pytorch", None, errors)
    return Probe(
        cuda=True,
        transformer_engine=te,
        te_grouped_linear=te and _imports("transformer_engine.pytorch", "GroupedLinear", errors),
        flash_attn_2=_imports("flash_attn", "flash_attn_varlen_func", errors),
        # flash-attn 4's kernels are Hopper's and Blackwell's (SM 9.x, 10.x, 11.x: flash_attn/cute/interface.py)
        flash_attn_4=_cuda_major() >= 9 and _imports("flash_attn.cute", "flash_attn_varlen_func", errors),
        errors=errors,
    )


def _cuda_major() -> int:
    import torch

    return torch.cuda.get_device_capability()[0]


@dataclass(frozen=True)
class ThroughputPaths:
    """The paths one trainer rank takes (module docstring); `why` says what decided each."""

    layer_spec: Literal["transformer_engine", "local"]
    fusions: bool  # fused RoPE, bias-SwiGLU, norm + linear (TE spec only)
    grouped_gemm: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    attention: Attention
    why: dict[str, str] = field(default_factory=dict, compare=False)

    def line(self) -> str:
        return (f"trainer throughput paths: layer spec {self.layer_spec} (fusions {'on' if self.fusions else 'off'}), "
                f"MoE grouped GEMM {'on' if self.grouped_gemm else 'off'}, overlapped grad reduce "
                f"{'on' if self.overlap_grad_reduce else 'off'}, overlapped param gather "
                f"{'on' if self.overlap_param_gather else 'off'}, attention {self.attention}; "
                + "; ".join(f"{k}: {v}" for k, v in self.why.items()))


def select_paths(p: Probe, *, moe: bool, distributed_optimizer: bool, use_te: bool = True) -> ThroughputPaths:
    """The paths for a trainer that sees `p` (`use_te=False` keeps the local spec on CUDA, e.g. for parity
    checks against it)."""
    why: dict[str, str] = {}
    if not p.cuda:
        why["device"] = "CPU: local spec, no overlap, SDPA"
        return ThroughputPaths("local", False, False, False, False, "sdpa", why)
    te = p.transformer_engine and use_te
    why["layer_spec"] = ("Transformer Engine imports" if te else
                         "TE turned off" if p.transformer_engine else
                         "Transformer Engine not importable" + (f" ({p.errors['transformer_engine.pytorch']})"
                                                                if "transformer_engine.pytorch" in p.errors else ""))
    grouped = te and moe and p.te_grouped_linear
    if moe:
        why["grouped_gemm"] = "TE GroupedLinear" if grouped else "needs the TE spec and TE's GroupedLinear"
    if p.flash_attn_2:
        attention: Attention = "flash_attn_2"
    elif p.flash_attn_4:
        attention = "flash_attn_4"
        why["attention"] = "flash-attn 4 (flash_attn.cute); the flash-attn 2 entry point is absent"
    else:
        attention = "sdpa"
        why["attention"] = "no flash-attention varlen kernel imports: SDPA per sequence"
    why["overlap_param_gather"] = "off: the weight push reads the parameters right after the step"
    return ThroughputPaths("transformer_engine" if te else "local", te, grouped, True, False, attention, why)


_LOGGED: set[ThroughputPaths] = set()


def log_once(paths: ThroughputPaths, emit: Callable[[str], None] | None = None) -> bool:
    """Log `paths` the first time this process uses them; True when it logged."""
    if paths in _LOGGED:
        return False
    _LOGGED.add(paths)
    (emit or log.warning)(paths.line())
    return True


def varlen_kernel(attention: Attention):
    """The flash-attention varlen function of `attention` as `fn(q, k, v, cu_q, cu_k, max_q, max_k, *,
    softmax_scale, causal) -> out [T, heads, dim]`, or None for SDPA. flash-attn 4 has no dropout and returns
    (out, lse); attention dropout is 0 in this trainer (`model.transformer_config`)."""
    if attention == "flash_attn_2":
        from flash_attn import flash_attn_varlen_func as fa2

        return fa2
    if attention == "flash_attn_4":
        from flash_attn.cute import flash_attn_varlen_func as fa4

        def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, dropout_p=0.0):
            if dropout_p:
                raise ValueError("flash-attn 4 has no attention dropout")
            out = fa4(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                      softmax_scale=softmax_scale, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        return fn
    return None
