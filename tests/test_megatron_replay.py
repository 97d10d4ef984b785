"""Routing replay (R3) on the tiny MoE: the engine's routes make the trainer match the engine; bad routes fail."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = MARKS

GENS = (20, 30, 25, 16, 40, 22)


@pytest.fixture(scope="module")
def moe():
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    trainer = MegatronTrainer(tiny_path(moe=True), TrainerConfig(micro_batch_tokens=64))
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    """An engine stand-in whose weights are the trainer's rounded to bf16 (what a bf16 engine holds):
    transformers' log-probs and routes of every input position with those weights."""
    from safetensors.torch import load_file, save_file

    src = tiny_path(moe=True)
    out = tmp_path_factory.mktemp("engine") / "bf16"
    shutil.copytree(src, out)
    sd = load_file(f"{src}/model.safetensors")
    save_file({k: v.to(torch.bfloat16).float() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    seqs = fixed_sequences(6, gens=GENS)
    lps, routes = hf_token_logprobs(out, seqs, with_routes=True)
    _, own_routes = hf_token_logprobs(src, seqs, with_routes=True)
    for s, r in zip(seqs, routes, strict=True):
        s.routed_experts = r
    return seqs, np.concatenate(lps), routes, own_routes


def test_replay_matches_the_engine_more_closely_than_free_routing(moe, bf16_engine):
    seqs, engine_lp, routes, own = bf16_engine
    flipped = np.mean([(np.sort(a, -1) != np.sort(b, -1)).any(-1).mean() for a, b in zip(routes, own, strict=True)])
    assert flipped > 0  # the engine routes some tokens differently from the trainer's own top-k
    free, _ = moe.compute_logprobs(seqs, replay=False)
    replayed, _ = moe.compute_logprobs(seqs, replay=True)
    d_free, d_replay = np.abs(free - engine_lp), np.abs(replayed - engine_lp)
    assert d_replay.mean() < 0.5 * d_free.mean(), (d_replay.mean(), d_free.mean())
    assert d_replay.max() < d_free.max() and d_replay.max() < 0.05


def test_replaying_the_free_routes_changes_nothing_and_other_routes_do(moe):
    seqs = fixed_sequences(3, gens=GENS)
    _, own = hf_token_logprobs(tiny_path(moe=True), seqs, with_routes=True)
    for s, r in zip(seqs, own, strict=True):
        s.routed_experts = r
    free, _ = moe.compute_logprobs(seqs, replay=False)
    same, _ = moe.compute_logprobs(seqs, replay=True)
    assert np.abs(free - same).max() < 1e-6
    budget = moe.cfg.micro_batch_tokens
    moe.cfg.micro_batch_tokens = 10_000  # one pack of every sequence: routes follow the packed token order
    try:
        packed, _ = moe.compute_logprobs(seqs, replay=True)
    finally:
        moe.cfg.micro_batch_tokens = budget
    assert np.abs(free - packed).max() < 1e-5
    rng = np.random.default_rng(0)
    for s in seqs:  # valid but different routes: replay really routes by them
        s.routed_experts = np.argsort(rng.random(s.routed_experts.shape[:2] + (8,)), -1)[..., :2].astype(np.int32)
    other, _ = moe.compute_logprobs(seqs, replay=True)
    assert np.abs(other - free).max() > 1e-2


def test_defaults_replay_in_training_not_in_verification(moe, bf16_engine):
    from megatron_bridge.trainer import TrainerConfig

    assert TrainerConfig().replay_train is True and TrainerConfig().replay_verify is False
    seqs = bf16_engine[0]
    default, _ = moe.compute_logprobs(seqs)  # the verification forward: free routing by default
    free, _ = moe.compute_logprobs(seqs, replay=False)
    assert np.array_equal(default, free)


def _bad(seq, routes):
    from megatron_bridge.batch import TrainSequence

    return TrainSequence(prompt_ids=seq.prompt_ids, gen_ids=seq.gen_ids, routed_experts=routes)


@pytest.mark.parametrize("how", ["one_short", "one_long", "layers", "top_k", "range", "repeat", "float", "missing"])
def test_misfit_routed_experts_are_an_error(moe, bf16_engine, how):
    from megatron_bridge.replay import RoutingMismatch

    seqs = bf16_engine[0][:3]
    r = seqs[1].routed_experts
    bad = {
        "one_short": r[:-1],  # e.g. routes of prompt + output (forgot SGLang's "- 1") or a lost row
        "one_long": np.concatenate([r, r[-1:]]),
        "layers": r[:, :1],
        "top_k": r[..., :1],
        "range": np.where(r == r.max(), 8, r),
        "repeat": np.repeat(r[..., :1], 2, axis=-1),
        "float": r.astype(np.float32),
        "missing": None,
    }[how]
    batch = [seqs[0], _bad(seqs[1], bad), seqs[2]]
    with pytest.raises(RoutingMismatch):
        moe.compute_logprobs(batch, replay=True)
    # the trainer is still usable (nothing left half-set in the routers)
    ok, _ = moe.compute_logprobs(seqs, replay=True)
    assert np.isfinite(ok).all()


def test_rollverify_response_routes_are_prompt_then_generated(moe, bf16_engine):
    """rollverify's Response keeps prompt routes and per-token routes apart; train_sequence joins them."""
    from megatron_bridge.loop_adapter import train_sequence
    from rollverify.types import Response

    s = bf16_engine[0][0]
    p, g = s.prompt_ids.size, s.gen_ids.size
    resp = Response(group_id=0, index=0, prompt_ids=s.prompt_ids, max_new_tokens=g, token_ids=s.gen_ids,
                    logprobs=np.zeros(g, np.float32), versions=np.zeros(g, np.int64),
                    prompt_routed_experts=s.routed_experts[:p - 1], routed_experts=s.routed_experts[p - 1:])
    seq = train_sequence(resp)
    assert np.array_equal(seq.routed_experts, s.routed_experts) and np.array_equal(seq.gen_ids, s.gen_ids)
    a, _ = moe.compute_logprobs([seq], replay=True)
    b, _ = moe.compute_logprobs([s], replay=True)
    assert np.array_equal(a, b)


def test_recomputed_layers_replay_the_routes_of_their_forward():
    """Full recompute with routing replay: the backward's recomputed forward routes by the same (engine) routes
    as the forward, so the step equals the step without recompute; routes unlike the trainer's own top-k make
    a recompute that routed freely give another gradient. Several micro-batches: each recompute takes its own."""
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    seqs = fixed_sequences(4, gens=GENS[:4])
    lps, _ = hf_token_logprobs(tiny_path(moe=True), seqs, with_routes=True)
    rng = np.random.default_rng(1)
    for s, lp, adv in zip(seqs, lps, (1.0, -0.5, 0.7, -1.2), strict=True):
        s.rollout_logprobs, s.advantage = lp, adv
        s.routed_experts = np.argsort(rng.random((s.num_inputs, 2, 8)), -1)[..., :2].astype(np.int32)
    steps = {}
    for recompute in ("none", "full"):
        trainer = MegatronTrainer(tiny_path(moe=True), TrainerConfig(recompute=recompute, micro_batch_tokens=40,
                                                                       lr=1e-2))
        try:
            m = trainer.train_step(seqs)
        finally:
            trainer.close()
        steps[recompute] = (m["loss"], m["grad_norm"])
    assert steps["full"] == pytest.approx(steps["none"], rel=1e-6, abs=1e-7)
