"""Helpers for the Megatron-Core tests (imported by tests/test_megatron_*.py; pytest only reads conftest.py).

World-size-2 checks run as module-level functions in processes started by `megatron_bridge.parallel.spawn`
(gloo, a fresh port each time, a hard timeout); each such function does several checks so that the two
interpreter start-ups (~6 s each for Megatron-Core's import) are paid once per layout.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from rollverify.tiny_model import TinyModelSpec, ensure_tiny_model

SPAWN_TIMEOUT_S = 240.0


def quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def tiny_path(**kw) -> str:
    return str(ensure_tiny_model(TinyModelSpec(**kw)))


@pytest.fixture(scope="session")
def tiny_tied_path():
    return ensure_tiny_model(TinyModelSpec(tie_word_embeddings=True))


def fixed_tokens(n_seqs: int = 3, seed: int = 0, vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 13, 5, 9, 11][:n_seqs]
    return [torch.randint(4, vocab, (n,), generator=g) for n in lengths]


def fixed_sequences(n: int = 4, seed: int = 0, prompt: int = 5, gens=(6, 9, 3, 12, 7, 4)):
    """TrainSequences with deterministic prompts and generated tokens (no log-probs yet)."""
    from megatron_bridge.batch import TrainSequence

    rng = np.random.default_rng(seed)
    return [TrainSequence(rng.integers(4, 128, prompt), rng.integers(4, 128, g)) for g in gens[:n]]


def hf_logits(path, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Reference: transformers' forward of each sequence alone, concatenated."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([hf(s.view(1, -1)).logits[0] for s in seqs])


def hf_token_logprobs(path, seqs, temperature: float = 1.0, with_routes: bool = False):
    """Engine stand-in: per generated token log_softmax(logits / T) at the token from transformers, and (MoE)
    the routed experts of every input position `[P + G - 1, layers, top_k]` from its router logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lps, routes = [], []
    with torch.no_grad():
        for s in seqs:
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.gen_ids]))[:-1].view(1, -1)
            out = hf(ids, output_router_logits=with_routes)
            logp = torch.log_softmax(out.logits[0].float() / temperature, dim=-1)
            p = s.prompt_ids.size
            rows = torch.arange(p - 1, p - 1 + s.gen_ids.size)
            lps.append(logp[rows, torch.from_numpy(s.gen_ids)].numpy())
            if with_routes:
                k = hf.config.num_experts_per_tok
                routes.append(np.stack([rl.view(ids.shape[1], -1).topk(k, dim=-1).indices.numpy()
                                        for rl in out.router_logits], axis=1).astype(np.int32))
    return lps, routes
