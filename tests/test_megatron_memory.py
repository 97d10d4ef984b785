"""Linear-memory pieces of the trainer: packed attention without an [s, s] tensor, log-probs by chunks.

Both are checked against the dense computation they replace (values and gradients) and by the sizes of the
tensors autograd keeps for the backward, which is where an [s, s] score matrix or a [tokens x vocab] logits
copy would show up.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron_fixtures import MARKS

pytestmark = MARKS


class _SavedSizes:
    """Largest tensor (elements) autograd saves for the backward inside the block."""

    def __init__(self) -> None:
        self.largest = 0

    def __enter__(self):
        def pack(t):
            self.largest = max(self.largest, t.numel())
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _dense_packed_attention(q, k, v, lengths, scale):
    """Reference: one [T, T] block-diagonal causal mask over the whole pack."""
    t, h, d = q.shape
    g = k.shape[1]
    k, v = (x.repeat_interleave(h // g, dim=1) for x in (k, v))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    p = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v).reshape(t, h * d)


def test_packed_attention_equals_block_diagonal_dense_and_keeps_no_square_tensor():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from megatron_bridge.attention import PackedCoreAttention
    from megatron_bridge.parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(), device="cpu", seed=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    attn = PackedCoreAttention(cfg, layer_number=1, attn_mask_type=None).train()
    lengths = [90, 1, 37, 128]
    t = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(t, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(t, 2, 8, generator=g, requires_grad=True)
    cu = torch.tensor([0, 90, 91, 128, 256], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=128,
                             max_seqlen_kv=128)
    with _SavedSizes() as saved:
        out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 32)
    assert saved.largest < t * t, saved.largest  # q alone is t*32 elements; one score matrix is t*t*4
    ref = _dense_packed_attention(q, k, v, lengths, 8 ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no dense attention mask"):
        attn(q, k, v, torch.zeros(1, 1, t, t, dtype=torch.bool), packed_seq_params=params)


def test_chunked_logprobs_equal_the_full_computation_and_keep_one_chunk():
    from megatron_bridge.logprobs import chunked_logprob_entropy, vocab_parallel_logprob_entropy

    g = torch.Generator().manual_seed(0)
    n, h, v = 50, 16, 300
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    for temperature in (1.0, 0.7):
        lp_ref, ent_ref = vocab_parallel_logprob_entropy(hidden @ weight.t(), targets, temperature=temperature)
        with _SavedSizes() as saved:
            lp, ent = chunked_logprob_entropy(hidden, weight, targets, temperature=temperature, chunk_tokens=8)
        assert saved.largest <= max(8 * v, v * h), saved.largest  # one chunk's logits at most, never n x v
        assert (lp - lp_ref).abs().max() < 1e-6 and (ent - ent_ref).abs().max() < 1e-6
        coef = torch.randn(n, generator=g)
        got = torch.autograd.grad((lp * coef + ent).sum(), (hidden, weight))
        want = torch.autograd.grad((lp_ref * coef + ent_ref).sum(), (hidden, weight))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # sums over chunks in another order


def test_gpu_smoke_part_a_dry_run_on_cpu(tmp_path):
    """tools/gpu_smoke.py's part A logic through the same code on CPU (a subset of its checks), loading none of
    the project's heavy dependencies."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rollverify.app.tiny_model import cache_root

    root = Path(__file__).resolve().parent.parent
    # a fresh single-process group: not the rendezvous this test process may hold
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}
    env["ROLLVERIFY_CACHE"] = str(cache_root())
    checks = "parity_dense_fp32,routing_replay_bitwise,verify_device_equals_cpu,imports_part_a"
    out = subprocess.run(
        [sys.executable, str(root / "tools" / "gpu_smoke.py"), "--device", "cpu", "--quick", "--checks", checks,
         "--json", str(tmp_path / "smoke.json"), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [line.split(":")[0] for line in lines] == [f"PASS {c}" for c in checks.split(",")] + ["PASS all"]
    report = json.loads((tmp_path / "smoke.json").read_text())
    figures = {c["name"]: c for c in report["checks"]}
    assert figures["parity_dense_fp32"]["value"] <= 1e-4
    assert report["info"]["device"] == "cpu" and report["info"]["quick"] is True
