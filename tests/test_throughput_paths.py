"""The trainer's GPU throughput paths (megatron_bridge.throughput) are chosen from the device and what imports:
every branch of the selection, the flash-attention 4 entry point's adapter, and the Transformer Engine spec's
parameter names the converter resolves. What runs on a GPU is in tools/gpu_smoke.py (not run here)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_bridge.throughput import Probe, log_once, probe, select_paths, varlen_kernel


def test_cpu_takes_the_local_spec_without_overlap_and_sdpa():
    assert probe("cpu") == Probe(cuda=False)  # nothing is imported for CPU
    p = select_paths(Probe(cuda=False, transformer_engine=True, flash_attn_2=True), moe=True,
                     distributed_optimizer=True)
    assert (p.layer_spec, p.fusions, p.grouped_gemm, p.overlap_grad_reduce, p.attention) == \
        ("local", False, False, False, "sdpa")


@pytest.mark.parametrize(
    ("probe_", "moe", "use_te", "want"),
    [
        (Probe(True, True, True, True, True), True, True, ("transformer_engine", True, True, "flash_attn_2")),
        (Probe(True, True, False, False, True), True, True, ("transformer_engine", True, False, "flash_attn_4")),
        (Probe(True, True, True, False, False), False, True, ("transformer_engine", True, False, "sdpa")),
        (Probe(True, True, True, False, True), True, False, ("local", False, False, "flash_attn_4")),
        (Probe(True, False, False, False, False, {"transformer_engine.pytorch": "ImportError: libcudnn"}), True, True,
         ("local", False, False, "sdpa")),
    ],
    ids=["te-grouped-fa2", "te-no-grouped-linear-fa4", "te-dense-sdpa", "te-turned-off", "no-te"],
)
def test_cuda_selection(probe_, moe, use_te, want):
    p = select_paths(probe_, moe=moe, distributed_optimizer=True, use_te=use_te)
    assert (p.layer_spec, p.fusions, p.grouped_gemm, p.attention) == want
    assert p.overlap_grad_reduce and not p.overlap_param_gather  # the push reads parameters right after the step
    if not probe_.transformer_engine:
        assert "libcudnn" in p.why["layer_spec"]  # why the fast path was not taken is in the log line
    if moe:
        assert "grouped_gemm" in p.why


def test_paths_are_logged_once_per_process():
    lines: list[str] = []
    p = select_paths(Probe(True, False, False, False, True), moe=False, distributed_optimizer=True)
    assert log_once(p, lines.append) and not log_once(p, lines.append)
    assert len(lines) == 1 and "attention flash_attn_4" in lines[0] and "layer spec local" in lines[0]


def test_flash_attn_4_adapter(monkeypatch):
    """flash-attn 4's wheel ships only `flash_attn.cute` (keyword cu_seqlens, no dropout, returns (out, lse))."""
    calls = {}

    def fa4(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            softmax_scale=None, causal=False, **rest):
        calls.update(cu_q=cu_seqlens_q, max_k=max_seqlen_k, scale=softmax_scale, causal=causal)
        return q * 2, torch.zeros(1)

    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fa4
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    fn = varlen_kernel("flash_attn_4")
    q = torch.ones(5, 2, 4)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = fn(q, q, q, cu, cu, 3, 3, dropout_p=0.0, softmax_scale=0.5, causal=True)
    assert torch.equal(out, q * 2) and calls == {"cu_q": cu, "max_k": 3, "scale": 0.5, "causal": True}
    with pytest.raises(ValueError, match="no attention dropout"):
        fn(q, q, q, cu, cu, 3, 3, dropout_p=0.1, softmax_scale=0.5, causal=True)
    assert varlen_kernel("sdpa") is None


def test_te_spec_parameter_names_resolve_to_the_converters():
    """Megatron-Core 0.16.1's TE spec fuses the layer norms into linear_qkv / linear_fc1 (`layer_norm_weight`) and
    names grouped experts `experts.linear_fc1.weight{e}` (gpt_layer_specs.py, TEGroupedMLP)."""
    from megatron_bridge.convert import Params, te_name

    assert te_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert te_name("decoder.layers.3.pre_mlp_layernorm.weight") == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    assert te_name("decoder.layers.0.mlp.experts.local_experts.11.linear_fc2.weight") == \
        "decoder.layers.0.mlp.experts.linear_fc2.weight11"
    assert te_name("decoder.layers.0.self_attention.linear_qkv.weight") == \
        "decoder.layers.0.self_attention.linear_qkv.weight"
    w, n = torch.zeros(1), torch.ones(1)
    moe = Params({"decoder.layers.0.pre_mlp_layernorm.weight": n,  # an MoE layer keeps its own TENorm
                  "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": w})
    assert moe["decoder.layers.0.pre_mlp_layernorm.weight"] is n
    assert moe["decoder.layers.0.input_layernorm.weight"] is w and "decoder.layers.0.input_layernorm.weight" in moe
    assert moe.key("decoder.layers.0.input_layernorm.weight") == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"


# --- the kernel check and the SDPA fallback without a host read -------------------------------------------------


def _sdpa_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal, dropout_p=0.0):
    """A correct varlen kernel on CPU (SDPA per sequence, GQA), standing in for a flash kernel."""
    import torch.nn.functional as F

    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        x = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*x, is_causal=causal, scale=softmax_scale,
                                                   enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def test_a_kernel_is_run_before_it_is_chosen_and_passed_over_with_the_reason():
    from megatron_bridge.throughput import check_kernel

    assert check_kernel(_sdpa_kernel, "cpu") is None
    not_causal = check_kernel(lambda *a, **k: _sdpa_kernel(*a, **{**k, "causal": False}), "cpu")
    assert "output differs from SDPA by" in not_causal
    # query heads mapped to the wrong key-value group (interleaved instead of consecutive)
    grouping = check_kernel(lambda q, k, v, *a, **kw: _sdpa_kernel(q, k.repeat(1, 2, 1), v.repeat(1, 2, 1), *a, **kw),
                            "cpu")
    assert "output differs from SDPA" in grouping
    no_backward = check_kernel(lambda *a, **k: _sdpa_kernel(*a, **k).detach().requires_grad_(True), "cpu")
    assert no_backward == "a causal varlen GQA check gave dq of shape None, expected (16, 4, 64)"
    raising = check_kernel(lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel image for sm_90")), "cpu")
    assert raising == ("a causal varlen forward and backward with GQA raised RuntimeError: no kernel image for "
                       "sm_90")
    # what select_paths then logs: the failed kernel and why, the fallback taken
    p = select_paths(Probe(True, False, False, False, True, {"flash_attn_2": raising}), moe=False,
                     distributed_optimizer=True)
    assert p.attention == "flash_attn_4" and p.why["attention"].startswith("flash_attn_2 failed its check: a causal")
    p = select_paths(Probe(True, False, False, False, False, {"flash_attn_4": not_causal}), moe=False,
                     distributed_optimizer=True)
    assert p.attention == "sdpa" and p.why["attention"].endswith(": SDPA per sequence") and "flash_attn_4" in \
        p.why["attention"]


@pytest.mark.megatron  # the packed attention is a Megatron-Core module
def test_the_sdpa_fallback_reads_no_boundary_from_the_device():
    """The packed SDPA path takes the sequence boundaries from the pack's host copy (`host_bounds`): with the
    device copy on the meta device, which nothing can read back, a layer call gives the same output."""
    from types import SimpleNamespace

    from megatron_bridge.attention import PackedCoreAttention
    from megatron_bridge.model import PackedSequences

    pack = PackedSequences.pack([torch.arange(5), torch.arange(11)], pad_to_multiple=4)
    params = pack.seq_params("cpu")
    assert params.host_bounds == (0, 5, 16)
    attn = PackedCoreAttention.__new__(PackedCoreAttention)
    torch.nn.Module.__init__(attn)
    attn.heads, attn.groups, attn.head_dim, attn.softmax_scale = 4, 2, 16, 0.25
    attn.dropout, attn.cp_group, attn.attention, attn._flash = 0.0, None, "sdpa", None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, n, 16, generator=gen) for n in (4, 2, 2))
    want = attn(q, k, v, None, packed_seq_params=params)
    blind = SimpleNamespace(**{**vars(params), "cu_seqlens_q": params.cu_seqlens_q.to("meta"), "cu_seqlens_kv": None})
    assert torch.equal(attn(q, k, v, None, packed_seq_params=blind), want)
    with pytest.raises(NotImplementedError):  # without the host copy the meta device cannot be read
        attn(q, k, v, None, packed_seq_params=SimpleNamespace(**{**vars(blind), "host_bounds": None}))
