"""Core attention for packed variable-length sequences whose memory grows linearly with the tokens.

Megatron-Core's local `DotProductAttention` materialises `[b, heads, s, s]` scores and takes a dense mask; it
refuses packed (THD) input. `PackedCoreAttention` replaces it in the layer spec and takes the packed layout
from `PackedSeqParams` (`qkv_format="thd"`, `cu_seqlens`): query `[T, heads, dim]`, key/value
`[T, groups, dim]`, causal inside each sequence and nothing across sequences. No `[s, s]` tensor exists:

- CUDA, bf16 / fp16, a flash-attention varlen kernel chosen at start (`megatron_bridge.throughput`: flash-attn 2,
  or flash-attn 4's `flash_attn.cute`, which sglang's GPU install brings): one kernel over the whole pack.
- Otherwise (float32, CUDA without it, and CPU): torch's `scaled_dot_product_attention` per sequence with
  `is_causal=True`; on CUDA torch picks its flash / memory-efficient kernels, on CPU its flash CPU kernel,
  all of which keep O(s) state (log-sum-exp) for the backward instead of the score matrix. The sequence
  boundaries come as Python ints with the pack (`host_bounds`, `model.PackedSequences.seq_params`), so a layer
  call never waits on the device to read them (they are read back once only for params built elsewhere).

Non-packed input (`sbhd`, no `PackedSeqParams`) is plain causal attention over each row; a dense
`attention_mask` is refused, since honouring it is exactly the `[s, s]` cost this module exists to avoid.

Context parallelism (cp > 1, packed input only): each rank holds, of every sequence, chunks `r` and
`2cp - 1 - r` of 2cp equal chunks (`model.PackedSequences.context_parallel_index`; `cu_seqlens` are the whole
pack's). Keys and values are all-gathered over the CP group (the backward reduce-scatters their gradients), and
each local chunk attends to its sequence's keys up to its own end, causally aligned to the end (a query at
position p sees keys <= p): FlashAttention's varlen kernel does that alignment itself; SDPA gets the chunk's
queries after zero queries standing for the earlier positions, and their rows are dropped (their zero output
gradient adds nothing to the keys' and values' gradients). Memory stays linear: one sequence's keys and values.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

KERNELS_RUN: set[str] = set()  # which kernels this process's packed attention has run ("flash_attn_4", "sdpa", ...)


class PackedCoreAttention(MegatronModule):
    """Drop-in `core_attention` of Megatron-Core's `SelfAttention` (same constructor and call signature)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by PackedCoreAttention")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.layer_number = layer_number
        # the varlen kernel the trainer chose at start (megatron_bridge.throughput); SDPA without one
        self.attention = getattr(config, "rollverify_attention", "sdpa")
        self._flash = None

    def _kernel(self, query):
        """The flash varlen kernel for CUDA bf16 / fp16 input when one was chosen, else None (SDPA)."""
        if self.attention == "sdpa" or not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
            return None
        if self._flash is None:
            from megatron_bridge.throughput import varlen_kernel

            self._flash = varlen_kernel(self.attention)
        return self._flash

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by PackedCoreAttention")
        if attention_mask is not None:
            raise ValueError("PackedCoreAttention takes no dense attention mask: describe packed sequences "
                             "with PackedSeqParams(qkv_format='thd', cu_seqlens_q=...) instead")
        p = self.dropout if self.training else 0.0
        if packed_seq_params is None:  # sbhd: [s, b, heads, dim], causal per row
            if self.cp_group is not None:
                raise ValueError("context parallelism needs packed (THD) input with PackedSeqParams")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            out = self._sdpa(q, k, v, p)
            s, b = query.shape[:2]
            return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedCoreAttention takes qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
        cu = packed_seq_params.cu_seqlens_q
        if packed_seq_params.cu_seqlens_kv is not None and packed_seq_params.cu_seqlens_kv is not cu and \
                not torch.equal(packed_seq_params.cu_seqlens_kv, cu):
            raise ValueError("self-attention over packed sequences needs cu_seqlens_kv == cu_seqlens_q")
        t = query.shape[0]
        flash = self._kernel(query)
        KERNELS_RUN.add(self.attention if flash is not None else "sdpa")
        bounds = list(getattr(packed_seq_params, "host_bounds", None) or cu.tolist())
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, bounds, p, flash)
        if flash is not None:
            cu32 = cu.to(device=query.device, dtype=torch.int32)
            m = int(packed_seq_params.max_seqlen_q)
            out = flash(query, key, value, cu32, cu32, m, m, dropout_p=p, softmax_scale=self.softmax_scale,
                        causal=True)
            return out.reshape(t, self.heads * self.head_dim)
        pieces = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if b == a:
                continue
            q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, h, n, d]
            pieces.append(self._sdpa(q, k, v, p)[0].transpose(0, 1))  # [n, h, d]
        if bounds[-1] != t:
            raise ValueError(f"cu_seqlens cover {bounds[-1]} tokens, the packed input has {t}")
        return torch.cat(pieces).reshape(t, self.heads * self.head_dim)

    def _context_parallel(self, query, key, value, bounds: list[int], p: float, flash):
        """This rank's chunks of every sequence against the sequence's gathered keys (module docstring)."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        cp, rank = self.cp_group.size(), self.cp_group.rank()
        t_local = query.shape[0]
        if bounds[-1] != t_local * cp:
            raise ValueError(f"cu_seqlens cover {bounds[-1]} tokens, cp={cp} ranks hold {t_local} each")
        k_all, v_all = (gather_from_sequence_parallel_region(x, True, group=self.cp_group) for x in (key, value))
        # row of the gathered [cp * t_local] keys holding global position g, segment by segment
        rows, q_chunks, local = [], [], 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            c = (b - a) // (2 * cp)
            if c == 0:
                continue
            seg = torch.arange(2 * cp * c).view(2 * cp, c)
            owner = torch.tensor([j if j < cp else 2 * cp - 1 - j for j in range(2 * cp)])
            half = torch.tensor([0 if j < cp else 1 for j in range(2 * cp)])
            seg_rows = owner.view(-1, 1) * t_local + local + half.view(-1, 1) * c + seg % c
            rows.append(seg_rows.reshape(-1))
            for j, start in ((rank, rank * c), (2 * cp - 1 - rank, (2 * cp - 1 - rank) * c)):
                q_chunks.append((local + (0 if j < cp else c), c, len(rows) - 1, start + c))
            local += 2 * c
        pieces = []
        keys = [(k_all.index_select(0, r.to(k_all.device)), v_all.index_select(0, r.to(v_all.device)))
                for r in rows]
        if flash is not None:
            qs = torch.cat([query[q0:q0 + n] for q0, n, _, _ in q_chunks])
            ks = torch.cat([keys[i][0][:end] for _, _, i, end in q_chunks])
            vs = torch.cat([keys[i][1][:end] for _, _, i, end in q_chunks])
            cu_q = torch.tensor([0, *np.cumsum([n for _, n, _, _ in q_chunks])], dtype=torch.int32,
                                device=query.device)
            cu_k = torch.tensor([0, *np.cumsum([end for _, _, _, end in q_chunks])], dtype=torch.int32,
                                device=query.device)
            out = flash(qs, ks, vs, cu_q, cu_k, max(n for _, n, _, _ in q_chunks),
                        max(end for _, _, _, end in q_chunks), dropout_p=p, softmax_scale=self.softmax_scale,
                        causal=True)  # FlashAttention >= 2.1 aligns the causal mask to the end
            return out.reshape(t_local, self.heads * self.head_dim)
        for q0, n, i, end in q_chunks:
            q = query[q0:q0 + n]
            q = torch.cat([q.new_zeros(end - n, *q.shape[1:]), q])  # queries for positions 0..end-n-1: dropped
            k, v = keys[i][0][:end], keys[i][1][:end]
            o = self._sdpa(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), p)[0].transpose(0, 1)
            pieces.append(o[end - n:])
        return torch.cat(pieces).reshape(t_local, self.heads * self.head_dim)

    def _sdpa(self, q, k, v, p: float):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=self.groups != self.heads)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with Megatron-Core's norm constructor, usable under sequence parallelism.

    Megatron-Core's non-TE norm (`WrappedTorchNorm`, the same torch RMSNorm) refuses `sequence_parallel`. Under
    SP each TP rank normalises its own slice of the tokens, so its weight gradient is a partial sum: the weight
    is marked `sequence_parallel`, which makes `finalize_model_grads` sum it over the TP group (as TE's norms
    are marked). Same parameter name (`weight`) and values as the module it replaces.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        if config.normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm is a plain RMSNorm (normalization='RMSNorm', no zero-centred "
                             "gamma)")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
