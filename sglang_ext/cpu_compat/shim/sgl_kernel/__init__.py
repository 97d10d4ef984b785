"""Pure-torch stand-in for `sgl_kernel` on CPU-only machines (part of sglang_ext.cpu_compat).

PyPI has no CPU build of sgl_kernel, yet SGLang 0.5.23's CPU path imports a few of its `*_cpu` ops. This
package is importable only when `sglang_ext.cpu_compat.activate()` put its folder on PYTHONPATH (so SGLang's
scheduler and detokenizer children see it too). Semantics follow SGLang's own Triton kernels at the call sites
named below. `torch.ops.sgl_kernel.convert_weight_packed` is deliberately not registered: SGLang then sees no
AMX and every layer runs its pure-torch `forward_native` path.

Importing it also applies the three host-side fixes SGLang's CPU path needs (see `_patch_host_alloc`,
`_cpu_device_module`, and `sglang_ext.cpu_compat.retry_shm_handshake` for the scheduler's weight payloads).
"""

from __future__ import annotations

import ctypes
import importlib.abc
import sys

import torch

__version__ = "0.0.0+rollverify.cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = the request's slice of out_cache_loc (srt/mem_cache/allocation.py)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends, strict=True):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every layer buffer (raw pointer + bytes per slot), copy slot src_loc[i] to tgt_loc[i]
    (kernels/ops/kvcache/cache_move.py). Sources are read before any target is written, as in the kernel."""
    ptrs = data_ptrs.tolist()
    strd = strides.tolist()
    tgt = tgt_loc.tolist()
    src = src_loc.tolist()
    for base, stride in zip(ptrs, strd, strict=True):
        saved = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, blob in zip(tgt, saved, strict=True):
            ctypes.memmove(base + t * stride, blob, stride)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """bonus[i] = accept_tokens.flat[i * stride + accept_lens[i] - 1] (kernels/ops/speculative/eagle.py)."""
    n = accept_lens.shape[0]
    idx = torch.arange(n, device=accept_lens.device) * accept_stride + accept_lens.long() - 1
    bonus_tokens[:n] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """Compact out_cache_loc at the accepted (!= -1) indices, in order (kernels/ops/speculative/eagle.py)."""
    flat = accept_index.reshape(-1)
    src = flat[flat != -1].long()
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None,
) -> None:
    """Shift each request's ids left by one and write its new token last
    (kernels/ops/speculative/multi_layer_eagle.py)."""
    for i, (s, n) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist(), strict=True)):
        if n <= 0:
            continue
        input_ids[s : s + n - 1] = input_ids[s + 1 : s + n].clone()
        last = int(select_index[i]) if select_index is not None else s + n - 1
        input_ids[last] = topk_index.reshape(-1)[i]


def _unsupported(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in in RollVerify: speculative decoding is not supported on CPU"
        )

    op.__name__ = name
    return op


build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
build_draft_decode_metadata_cpu = _unsupported("build_draft_decode_metadata_cpu")
assign_draft_cache_locs_contiguous_cpu = _unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")


# --- host allocation -------------------------------------------------------------------------------------
_HOST_ALLOC_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _plain_host_alloc(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    """Routed-expert capture allocates its host buffer with cudaHostRegister; without CUDA, plain memory."""
    return torch.empty(dims, dtype=dtype, device="cpu")


def _patch_host_alloc(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_alloc


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies `_patch_host_alloc` right after SGLang's host-pool module executes, in whichever process."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _HOST_ALLOC_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch_host_alloc(module)

        loader.exec_module = exec_module
        return spec


if _HOST_ALLOC_MODULE in sys.modules:
    _patch_host_alloc(sys.modules[_HOST_ALLOC_MODULE])
elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())


def _cpu_device_module(get_device_module):
    """`torch.get_device_module()` with no device returns the current accelerator's module, "or CPU if none is
    present"; a CUDA build without a driver still reports CUDA, so SGLang's release_memory_occupation
    (scheduler_components/weight_updater.py: `torch.get_device_module().synchronize()`) kills the scheduler on
    CPU. Without a usable CUDA device the no-argument call answers `torch.cpu`; any explicit device is untouched."""

    def patched(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return get_device_module(device)

    patched.rollverify_cpu = True  # applied once per process
    return patched


if not getattr(torch.get_device_module, "rollverify_cpu", False):
    torch.get_device_module = _cpu_device_module(torch.get_device_module)


def _retry_shm_handshake() -> None:
    from sglang_ext.cpu_compat import retry_shm_handshake

    retry_shm_handshake()


_retry_shm_handshake()
