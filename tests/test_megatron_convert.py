"""HF <-> Megatron-Core conversion: logits parity with transformers, bit-exact export, bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from megatron_fixtures import MARKS, fixed_tokens, hf_logits, tiny_path, ws2_stack

pytestmark = MARKS

VARIANTS = {"dense": {}, "moe": {"moe": True}, "tied": {"tie_word_embeddings": True}}


def _build(path, **kw):
    from megatron_bridge.convert import load_hf_checkpoint
    from megatron_bridge.model import ModelArch, build_model, transformer_config
    from megatron_bridge.parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(), device="cpu")
    arch = ModelArch.from_hf_dir(path)
    model = build_model(arch, transformer_config(arch))
    if kw.get("load", True):
        load_hf_checkpoint(model, path)
    return model.eval(), arch


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_world_size_1_logits_parity_and_bit_exact_export(variant):
    from megatron_fixtures import _roundtrip_errors

    from megatron_bridge.model import PackedSequences, packed_forward

    path = tiny_path(**VARIANTS[variant])
    model, arch = _build(path)
    seqs = fixed_tokens(4)
    with torch.no_grad():
        logits = packed_forward(model, PackedSequences.pack(seqs))[0]
    ref = hf_logits(path, seqs)
    # packed sequences see exactly what they see alone: parity holds for the later ones too
    assert (logits - ref).abs().max().item() < 1e-4
    assert _roundtrip_errors(model, arch, path) == []


def test_yarn_rope_scaling_from_the_hf_config_matches_transformers(tmp_path):
    """Qwen3's long-context YaRN (rope_type "yarn"): default and explicit attention factor, sequences past the
    original context."""
    from megatron_bridge.model import ModelArch, PackedSequences, packed_forward

    seqs = [torch.randint(4, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (150, 40, 7)]
    plain = hf_logits(tiny_path(), seqs)
    for extra in ({}, {"attention_factor": 1.3, "beta_fast": 16.0}):
        path = tmp_path / f"yarn{len(extra)}"
        shutil.copytree(tiny_path(), path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["max_position_embeddings"] = 192
        cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48,
                                  "rope_theta": 10000.0, **extra}
        (path / "config.json").write_text(json.dumps(cfg))
        model, arch = _build(path)
        assert arch.context_length == 192 and arch.yarn_factor == 4.0
        with torch.no_grad():
            logits = packed_forward(model, PackedSequences.pack(seqs))[0]
        assert (logits - hf_logits(path, seqs)).abs().max().item() < 1e-4
        assert (logits - plain).abs().max().item() > 1e-2  # the scaling is really applied
    cfg["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0}
    with pytest.raises(ValueError, match="default RoPE or YaRN"):
        ModelArch.from_hf_config(cfg)


@pytest.mark.parametrize(("tp", "ep", "moe"), [(2, 1, False), (1, 2, True)], ids=["tp2-dense", "ep2-moe"])
def test_world_size_2_logits_parity_and_bit_exact_export(tp, ep, moe):
    ref = hf_logits(tiny_path(moe=moe), [s[:-1] for s in fixed_tokens(3)])
    for rank in ws2_stack(tp, ep, moe):
        assert rank["roundtrip"] == []
        assert (rank["logits"] - ref).abs().max().item() < 1e-4


def test_export_names_and_order_cover_the_checkpoint():
    from safetensors import safe_open

    from megatron_bridge.convert import hf_tensor_names
    from megatron_bridge.model import ModelArch

    for kw in VARIANTS.values():
        path = tiny_path(**kw)
        names = hf_tensor_names(ModelArch.from_hf_dir(path))
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            assert sorted(names) == sorted(f.keys()) and len(set(names)) == len(names)


def _copy(path, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(path, out)
    return out


def test_unsupported_architecture_lists_supported(tmp_path):
    from megatron_bridge.model import SUPPORTED_ARCHITECTURES, ModelArch, UnsupportedCheckpoint
    from megatron_bridge.trainer import MegatronTrainer

    bad = _copy(tiny_path(), tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    for make in (lambda: ModelArch.from_hf_dir(bad), lambda: MegatronTrainer(bad)):
        with pytest.raises(UnsupportedCheckpoint) as e:
            make()
        assert "LlamaForCausalLM" in str(e.value) and all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_shape_mismatch_names_the_tensor_and_loads_nothing(tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_bridge.convert import CheckpointMismatch, load_hf_checkpoint
    from megatron_bridge.model import unwrap

    good = tiny_path()
    bad = _copy(good, tmp_path)
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)  # config says [128, 64]
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})

    model, arch = _build(good)
    before = {k: v.clone() for k, v in unwrap(model).state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CheckpointMismatch) as e:
        load_hf_checkpoint(model, bad)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and "[96, 64]" in str(e.value)
    after = unwrap(model).state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # nothing half-loaded

    del sd["model.norm.weight"]
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="model.norm.weight: missing"):
        load_hf_checkpoint(model, bad)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
