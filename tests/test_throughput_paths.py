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
