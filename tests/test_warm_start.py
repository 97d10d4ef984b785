"""Warm start: the warm-started tiny model samples a useful reward; same seed, same weights."""

from __future__ import annotations

import pytest
import torch

from rollverify.app.tiny_model import TinyModelSpec, build_tokenizer, ensure_tiny_model, make_tiny_model
from rollverify.app.warm_start import (
    WarmStartRecipe,
    evaluate_reward,
    recipe_fingerprint,
    sample_responses,
    supervised_warm_start,
    warm_start,
    weights_digest,
)
from rollverify.tasks import get_task


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def task():
    return get_task("countdown")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(128)


def test_same_seed_same_weights(tiny_dense_path, task, tok):
    """A reduced budget: determinism does not need the full recipe."""
    recipe = WarmStartRecipe(steps=12, batch_size=8, micro_batch=4, warmup=2)
    digests = []
    for seed in (0, 0, 1):
        model = _load(tiny_dense_path)
        before = weights_digest(model)
        res = supervised_warm_start(model, tok, task, recipe, seed=seed)
        assert res.steps == 12 and res.final_loss < 5.0
        digests.append(weights_digest(model))
        assert digests[-1] != before
    assert digests[0] == digests[1] != digests[2]
    assert torch.get_num_threads() >= 1  # the single-thread guard restored the setting


def test_warm_started_model_beats_base(tiny_dense_path, task, tok):
    """The cached task model (the same one the loop starts from) against its own untrained init."""
    warm_path = ensure_tiny_model(TinyModelSpec(task="countdown"))
    base, warm = _load(tiny_dense_path), _load(warm_path)
    evals = task.examples("eval", 96, seed=0)
    r_base = evaluate_reward(base, tok, task, evals, seed=1)
    r_warm = evaluate_reward(warm, tok, task, evals, seed=1)
    assert r_warm >= r_base + 0.15, (r_base, r_warm)
    assert 0.15 <= r_warm <= 0.85, r_warm  # room left for RL: neither hopeless nor solved
    # sampling is reproducible for a seed
    prompts = [e.prompt for e in evals[:8]]
    a = sample_responses(warm, tok, prompts, max_new_tokens=40, seed=3)
    assert a == sample_responses(warm, tok, prompts, max_new_tokens=40, seed=3)


def test_recipe_fingerprint():
    assert recipe_fingerprint("countdown") == recipe_fingerprint("countdown")
    assert recipe_fingerprint("countdown") != recipe_fingerprint("countdown_short")


def test_tasks_without_demonstrations_are_refused(tmp_path, tiny_dense_path, tok):
    (tmp_path / "p.jsonl").write_text(
        "".join(f'{{"prompt": "{i}+1?", "label": "{i + 1}"}}\n' for i in range(40))
    )
    with pytest.raises(ValueError, match="no demonstrations"):
        supervised_warm_start(
            _load(tiny_dense_path), tok, get_task("math", train_path=tmp_path / "p.jsonl"), WarmStartRecipe()
        )
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_tiny_model(tmp_path / "m", TinyModelSpec(task="nope"))
    with pytest.raises(ValueError, match="unknown task"):
        warm_start(_load(tiny_dense_path), tok, TinyModelSpec(task="nope"))
