"""HF export of a trained policy: transformers loads it, its logits are the trainer's, the tokenizer (chat
template included) comes along, and the folder appears whole."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from megatron_fixtures import MARKS, fixed_sequences, hf_logits, hf_token_logprobs, tiny_path

from rollverify.app.export import export_trainer, find_checkpoint, hf_weight_buckets
from rollverify.tasks.chat import has_chat_template

pytestmark = MARKS

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


def test_export_after_a_step_has_the_trainers_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    src = tmp_path / "src"  # the tiny model with a chat template: the export must carry it
    shutil.copytree(tiny_path(), src)
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(src)

    trainer = MegatronTrainer(src, TrainerConfig(lr=1e-2, micro_batch_tokens=24))
    try:
        seqs = fixed_sequences(4)
        before, _ = hf_token_logprobs(src, seqs)
        for s, lp, a in zip(seqs, before, (1.0, -1.0, 0.5, -0.5), strict=True):
            s.rollout_logprobs, s.advantage = lp, a
        trainer.train_step(seqs)
        out = export_trainer(trainer, src, tmp_path / "run" / "hf" / "step_1")
        trained_lp, _ = trainer.compute_logprobs(seqs, temperature=1.0)
        state = trainer.export_hf_state()
    finally:
        trainer.close()

    assert out.is_dir() and sorted(p.name for p in out.parent.iterdir()) == ["step_1"]  # no partial folder left
    assert has_chat_template(out) and AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE
    exported_lp, _ = hf_token_logprobs(out, seqs)
    exported_lp, before = np.concatenate(exported_lp), np.concatenate(before)
    assert np.abs(exported_lp - trained_lp).max() < 1e-4  # transformers on the export == the trainer
    assert np.abs(exported_lp - before).max() > 1e-3  # ... and the step moved it off the initial weights

    # logits, exactly: the files hold the trainer's HF-named tensors (shards, index, names)
    tokens = [torch.from_numpy(np.concatenate([s.prompt_ids, s.gen_ids])) for s in seqs]
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state)
    with torch.no_grad():
        ref_logits = torch.cat([ref(t.view(1, -1)).logits[0] for t in tokens])
    assert torch.equal(hf_logits(out, tokens), ref_logits)
    loaded = {k: v for bucket in hf_weight_buckets(out, bucket_bytes=1 << 14) for k, v in bucket}
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_find_checkpoint_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint/trainer/rollverify_trainer.json there"):
        find_checkpoint(tmp_path)
    (tmp_path / "checkpoint" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoint" / "trainer" / "rollverify_trainer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"the run's config.json is not beside"):
        find_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert find_checkpoint(tmp_path) == find_checkpoint(tmp_path / "checkpoint") == tmp_path / "checkpoint"
