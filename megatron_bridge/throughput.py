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
  top-level import fails there), else torch's SDPA per sequence. A kernel that imports is also run before it
  is chosen (`check_kernel`: a tiny causal varlen forward and backward with grouped-query attention, two
  sequences, bf16, held to SDPA per sequence): one that raises or disagrees is passed over with the reason in
  the log line. CPU always takes the local spec, no overlap and SDPA.

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
    errors: dict[str, str] = field(default_factory=dict)  # what failed to import, or to run (`check_kernel`)


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
    fa2 = _imports("flash_attn", "flash_attn_varlen_func", errors)
    # flash-attn 4's kernels are Hopper's and Blackwell's (SM 9.x, 10.x, 11.x: flash_attn/cute/interface.py)
    fa4 = _cuda_major() >= 9 and _imports("flash_attn.cute", "flash_attn_varlen_func", errors)
    runs = {name: working(name, errors) for name, imported in (("flash_attn_2", fa2), ("flash_attn_4", fa4))
            if imported}
    return Probe(
        cuda=True,
        transformer_engine=te,
        te_grouped_linear=te and _imports("transformer_engine.pytorch", "GroupedLinear", errors),
        flash_attn_2=runs.get("flash_attn_2", False),
        flash_attn_4=runs.get("flash_attn_4", False),
        errors=errors,
    )


def working(attention: Attention, errors: dict[str, str], device: str = "cuda") -> bool:
    """Whether `attention`'s kernel passes `check_kernel` here; its failure goes to `errors[attention]`."""
    problem = check_kernel(varlen_kernel(attention), device)
    if problem is not None:
        errors[attention] = problem
    return problem is None


def check_kernel(fn, device: str = "cuda", dtype=None, *, lengths: tuple[int, ...] = (5, 11), heads: int = 4,
                 groups: int = 2, dim: int = 64, tol: float = 2e-2) -> str | None:
    """Run a varlen kernel (`varlen_kernel`'s signature) on a tiny pack: `lengths` sequences, causal, `heads`
    query heads over `groups` key-value heads (GQA), forward and backward, against SDPA per sequence in fp32.
    None when output and the gradients of q, k and v agree within `tol` (relative to their largest entry),
    else what went wrong."""
    import torch
    import torch.nn.functional as F

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, n, dim, generator=gen) for n in (heads, groups, groups))
    grad = torch.randn(total, heads, dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    scale = dim ** -0.5

    def ref():
        x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in x)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                       enable_gqa=True)[0].transpose(0, 1))
        out = torch.cat(outs)
        out.backward(grad)
        return [out.detach(), *(t.grad for t in x)]

    try:
        x = [t.detach().to(device, dtype, copy=True).requires_grad_(True) for t in (q, k, v)]
        c = cu.to(device)
        out = fn(*x, c, c, max(lengths), max(lengths), softmax_scale=scale, causal=True)
        out.backward(grad.to(device, dtype))
        got = [out.detach(), *(t.grad for t in x)]
    except Exception as e:  # noqa: BLE001 - any failure passes the kernel over, with the reason logged
        return f"a causal varlen forward and backward with GQA raised {type(e).__name__}: {e}"
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, ref(), strict=True):
        if a is None or a.shape != b.shape:
            return f"a causal varlen GQA check gave {name} of shape {None if a is None else tuple(a.shape)}, " \
                   f"expected {tuple(b.shape)}"
        err = (a.float().cpu() - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        if not err <= tol:
            return f"a causal varlen GQA check's {name} differs from SDPA by {err:.2e} (relative; allowed {tol})"
    return None


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
    failed = "; ".join(f"{k} failed its check: {p.errors[k]}" for k in ("flash_attn_2", "flash_attn_4")
                       if k in p.errors)
    if p.flash_attn_2:
        attention: Attention = "flash_attn_2"
    elif p.flash_attn_4:
        attention = "flash_attn_4"
        why["attention"] = failed or "flash-attn 4 (flash_attn.cute); the flash-attn 2 entry point is absent"
    else:
        attention = "sdpa"
        why["attention"] = (failed + ": SDPA per sequence") if failed else \
            "no flash-attention varlen kernel imports: SDPA per sequence"
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
