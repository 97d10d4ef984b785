"""Helpers for the Megatron-Core tests (imported by tests/test_megatron_*.py; pytest only reads conftest.py).

World-size-2 checks run as module-level functions in processes started by `megatron_bridge.parallel.spawn`
(gloo, a fresh port each time, a hard timeout); each such function does several checks so that the two
interpreter start-ups (~6 s each for Megatron-Core's import) are paid once per layout.
"""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import pytest
import torch

from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

SPAWN_TIMEOUT_S = 240.0

# Megatron-Core 0.16.1 warns about missing TE/apex and deprecations on every model build: not ours to fix.
MARKS = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
    pytest.mark.filterwarnings("ignore::FutureWarning:megatron.*"),
    pytest.mark.filterwarnings("ignore::FutureWarning:torch.distributed.*"),
]


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


def _roundtrip_errors(model, arch, path) -> list[str]:
    """Export the freshly loaded model and compare bit for bit with the checkpoint; returns what differs."""
    from safetensors.torch import load_file

    from megatron_bridge.convert import iter_hf_buckets, iter_hf_tensors

    ref = load_file(os.path.join(str(path), "model.safetensors"))
    seen, bad = set(), []
    for name, t in iter_hf_tensors(model, arch):
        seen.add(name)
        if name not in ref or t.dtype != ref[name].dtype or not torch.equal(t, ref[name]):
            bad.append(name)
    bad += [f"missing {n}" for n in set(ref) - seen]
    # the bucketed export (weight push), at a bucket size that splits a layer's experts over several buckets
    seen = set()
    for bucket in iter_hf_buckets(model, arch, bucket_bytes=2 << 10):
        for name, t in bucket:
            if name in seen or name not in ref or t.dtype != ref[name].dtype or not torch.equal(t, ref[name]):
                bad.append(f"bucketed {name}")
            seen.add(name)
    bad += [f"bucketed: missing {n}" for n in set(ref) - seen]
    return bad


def stack_run(tp: int = 1, ep: int = 1, moe: bool = False, lr: float = 1e-2) -> dict:
    """Build, forward (full logits), LM loss, backward, one Adam step, loss again. Runs on any rank."""
    quiet()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bridge.convert import load_hf_checkpoint
    from megatron_bridge.model import (
        ModelArch,
        PackedSequences,
        build_model,
        packed_forward,
        transformer_config,
    )
    from megatron_bridge.parallel import ParallelConfig, init_parallel

    path = tiny_path(moe=moe)
    init_parallel(ParallelConfig(tp=tp, ep=ep), device="cpu", seed=7)
    arch = ModelArch.from_hf_dir(path)
    cfg = transformer_config(arch, tp=tp, ep=ep)
    model = build_model(arch, cfg)
    load_hf_checkpoint(model, path)
    model = DistributedDataParallel(
        config=cfg, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True), module=model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [model])
    roundtrip = _roundtrip_errors(model, arch, path)
    seqs = fixed_tokens(3)
    batch = PackedSequences.pack([s[:-1] for s in seqs])
    labels = torch.cat([s[1:] for s in seqs]).view(1, -1)

    def loss_and_logits():
        logits = packed_forward(model, batch)  # [1, S, V/tp]
        # Megatron's vocab-parallel CE overwrites its input: give it a copy
        ce = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).clone(), labels.transpose(0, 1))
        return ce.mean(), logits

    model.train()
    model.zero_grad_buffer()
    opt.zero_grad()
    loss0, logits = loss_and_logits()
    loss0.backward()
    finalize_model_grads([model])  # DP reduction, and the TP sum of the qk-norm grads
    ok, grad_norm, _ = opt.step()
    with torch.no_grad():
        loss1, _ = loss_and_logits()
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach())
    return {"loss0": loss0.item(), "loss1": loss1.item(), "grad_norm": float(grad_norm), "ok": bool(ok),
            "logits": full[0].clone(), "tp_rank": ps.get_tensor_model_parallel_rank(), "roundtrip": roundtrip}


def _ws2_stack_worker(rank: int, world_size: int, tp: int, ep: int, moe: bool) -> dict:
    return stack_run(tp=tp, ep=ep, moe=moe)



@functools.cache
def ws2_stack(tp: int, ep: int, moe: bool) -> tuple[dict, ...]:
    """`stack_run` on 2 spawned ranks, once per layout per test session (shared by the stack and convert
    tests)."""
    from megatron_bridge.parallel import spawn

    return tuple(spawn(_ws2_stack_worker, 2, tp, ep, moe, timeout_s=SPAWN_TIMEOUT_S))
