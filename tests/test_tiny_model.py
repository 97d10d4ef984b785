"""make-tiny-model: deterministic files, a tokenizer covering the vocabulary, refusal to clobber."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rollverify.app.cli import main as cli_main
from rollverify.app.tiny_model import MARKER, TinyModelSpec, build_tokenizer, make_tiny_model, vocabulary


def _digest_dir(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize("moe", [False, True])
def test_same_seed_gives_byte_identical_files(tmp_path, moe):
    a = make_tiny_model(tmp_path / "a", TinyModelSpec(moe=moe, seed=3))
    b = make_tiny_model(tmp_path / "b", TinyModelSpec(moe=moe, seed=3))
    c = make_tiny_model(tmp_path / "c", TinyModelSpec(moe=moe, seed=4))
    da, db, dc = _digest_dir(a), _digest_dir(b), _digest_dir(c)
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= set(da)
    assert da == db
    assert da["model.safetensors"] != dc["model.safetensors"]


def test_moe_architecture(tiny_moe_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_moe_path)
    assert cfg.model_type == "qwen3_moe"
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    dense = json.loads((tiny_moe_path / MARKER).read_text())["spec"]
    assert dense["moe"] is True


def test_tokenizer_covers_whole_vocabulary(tiny_dense_path):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense_path)
    vocab_size = AutoConfig.from_pretrained(tiny_dense_path).vocab_size
    assert len(tok) == vocab_size
    for i in range(vocab_size):
        assert tok.convert_ids_to_tokens(i) == vocabulary(vocab_size)[i]
    text = "12+345=357\nDone."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0


def test_hf_forward_runs(tiny_dense_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dense_path, dtype=torch.float32)
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 128)
    assert logits.std() > 0.1  # the wider init gives a non-uniform policy


def test_refuses_non_empty_foreign_folder(tmp_path, capsys):
    target = tmp_path / "data"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    rc = cli_main(["make-tiny-model", "--out", str(target)])
    assert rc == 2
    assert "not a RollVerify tiny model" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert (target / "notes.txt").read_text() == "keep me"


def test_rewrites_its_own_model_for_a_new_spec(tmp_path):
    out = make_tiny_model(tmp_path / "m", TinyModelSpec(seed=1))
    first = _digest_dir(out)
    assert make_tiny_model(out, TinyModelSpec(seed=1)) == out and _digest_dir(out) == first
    make_tiny_model(out, TinyModelSpec(seed=2))
    assert _digest_dir(out)["model.safetensors"] != first["model.safetensors"]


def test_vocab_too_small_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(16)
