"""MegatronTrainer: ComputeProb against transformers, the GRPO step, metrics, checkpoints, TP/PP/EP = 2 steps."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = MARKS

ADV = [1.0, -1.0, 0.5, -0.5, 0.25, -0.25]


def _trainer(path, **kw):
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    kw.setdefault("micro_batch_tokens", 24)
    return MegatronTrainer(path, TrainerConfig(**kw))


def _rl_batch(path, n=4, moe=False, shift=0.0):
    """Sequences with engine-stand-in log-probs (transformers, same weights), routes (MoE) and advantages."""
    seqs = fixed_sequences(n)
    lps, routes = hf_token_logprobs(path, seqs, with_routes=moe)
    for i, s in enumerate(seqs):
        s.rollout_logprobs = lps[i] - shift
        s.advantage = ADV[i]
        if moe:
            s.routed_experts = routes[i]
    return seqs


@pytest.fixture(scope="module")
def dense():
    return _trainer(tiny_path(), lr=1e-2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_matches_transformers(dense, temperature):
    seqs = fixed_sequences(5)
    lp, ent = dense.compute_logprobs(seqs, temperature=temperature)
    ref, _ = hf_token_logprobs(tiny_path(), seqs, temperature=temperature)
    ref = np.concatenate(ref)
    assert lp.dtype == np.float32 and lp.shape == ref.shape == (sum(s.gen_ids.size for s in seqs),)
    assert np.abs(lp - ref).max() < 1e-4
    assert np.all(ent > 0) and np.all(ent <= np.log(128) + 1e-4)
    # neither the token budget of a micro-batch (how many sequences share a pack) nor the log-prob chunk changes
    # anything
    for budget, chunk in ((10_000, 1024), (10_000, 3), (40, 1)):
        dense.cfg.micro_batch_tokens, dense.cfg.logprob_chunk_tokens = budget, chunk
        try:
            lp_other, ent_other = dense.compute_logprobs(seqs, temperature=temperature)
        finally:
            dense.cfg.micro_batch_tokens, dense.cfg.logprob_chunk_tokens = 24, 1024
        assert np.abs(lp_other - lp).max() < 1e-5 and np.abs(ent_other - ent).max() < 1e-5


def test_entropy_is_that_of_the_tempered_distribution(dense):
    from transformers import AutoModelForCausalLM

    seqs = fixed_sequences(1)
    _, ent = dense.compute_logprobs(seqs, temperature=0.7)
    s = seqs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_path(), dtype=torch.float32).eval()
    ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.gen_ids])[:-1]).view(1, -1)
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0] / 0.7, -1)[s.prompt_ids.size - 1:]
    ref = -(logp.exp() * logp).sum(-1).numpy()
    assert np.abs(ent - ref).max() < 1e-4


def test_grpo_step_lowers_the_loss_and_reports_metrics():
    trainer = _trainer(tiny_path(), lr=1e-2)
    seqs = _rl_batch(tiny_path(), shift=0.1)  # engine 0.1 nats below the trainer on every token
    old, _ = trainer.compute_logprobs(seqs, replay=True)
    before = trainer.loss_on(seqs, old)
    m = trainer.train_step(seqs)
    after = trainer.loss_on(seqs, old)
    assert after["loss"] < before["loss"] - 1e-3, (before["loss"], after["loss"])
    assert abs(m["loss"] - before["loss"]) < 1e-6  # the step's loss is the loss at the old weights
    for key in ("loss", "grad_norm", "entropy", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
                "tis_weight_mean", "tis_weight_max", "tis_frac_capped", "mismatch_abs_mean", "mismatch_ops_mean",
                "approx_kl", "lr", "tokens"):
        assert np.isfinite(m[key]), key
    assert m["tokens"] == sum(s.gen_ids.size for s in seqs) and m["lr"] == pytest.approx(1e-2)
    # the recomputed old log-prob equals the current one at the first (only) micro-step: ratio 1, no clipping
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    # TIS: w = min(exp(lp_old_train - lp_rollout), 2) = exp(0.1); mismatch |0.1|
    assert m["tis_weight_mean"] == pytest.approx(np.exp(0.1), abs=1e-4) and m["tis_frac_capped"] == 0.0
    assert m["tis_weight_max"] == pytest.approx(np.exp(0.1), abs=1e-4)
    assert m["mismatch_abs_mean"] == pytest.approx(0.1, abs=1e-4)
    assert m["mismatch_ops_mean"] == pytest.approx(np.expm1(0.1), abs=1e-4)
    assert m["grad_norm"] > 0 and m["entropy"] > 0
    trainer.close()


def test_loss_normalises_by_tokens_not_by_weights():
    """Token-mean over the mini-batch: doubling every advantage doubles the loss; micro-batching is invisible."""
    trainer = _trainer(tiny_path(), micro_batch_tokens=12)
    seqs = _rl_batch(tiny_path(), shift=1.0)  # w = exp(1) clipped at 2 on every token
    old, _ = trainer.compute_logprobs(seqs)
    a = trainer.loss_on(seqs, old)
    trainer.cfg.micro_batch_tokens = 10_000
    b = trainer.loss_on(seqs, old)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["tis_frac_capped"] == 1.0
    n = sum(s.gen_ids.size for s in seqs)
    expected = sum(-s.advantage * 2.0 * s.gen_ids.size for s in seqs) / n
    assert a["loss"] == pytest.approx(expected, abs=1e-5)
    trainer.close()


@pytest.mark.parametrize("kind", ["gspo", "sapo", "vespo"])
def test_alternative_losses_step_and_normalise_like_rollverify(kind):
    """GSPO and SAPO (seq-mean-token-mean) and VESPO (token-mean) through Megatron's normalisation equal rollverify.losses on
    the whole batch at once, whatever the micro-batching."""
    from rollverify import losses

    trainer = _trainer(tiny_path(), lr=1e-2, micro_batch_tokens=12, loss=kind)
    seqs = _rl_batch(tiny_path(), shift=0.05)
    old, _ = trainer.compute_logprobs(seqs)
    got = trainer.loss_on(seqs, old + 0.01)  # ratio != 1 so the losses are not trivially equal
    t = lambda xs: torch.from_numpy(np.concatenate(xs).astype(np.float32))  # noqa: E731
    lp, old_t = t([old]), t([old + 0.01])
    roll = t([s.rollout_logprobs for s in seqs])
    adv = t([np.full(s.gen_ids.size, s.advantage, np.float32) for s in seqs])
    mask = torch.ones_like(lp)
    counts = [s.gen_ids.size for s in seqs]
    from megatron_bridge.policy_loss import _padded

    fn = {"gspo": losses.gspo_loss, "sapo": losses.sapo_loss, "vespo": losses.vespo_loss}[kind]
    ref, _ = fn(*(_padded(x, counts) for x in (lp, old_t, adv, mask)), rollout_logprobs=_padded(roll, counts))
    assert got["loss"] == pytest.approx(float(ref), abs=1e-5)
    m = trainer.train_step(seqs)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    trainer.close()


def test_train_step_rejects_incomplete_batches(dense):
    seqs = fixed_sequences(2)
    with pytest.raises(ValueError, match="no advantage"):
        dense.train_step(seqs)
    seqs[0].advantage = seqs[1].advantage = 1.0
    with pytest.raises(ValueError, match="rollout log-probs"):
        dense.train_step(seqs)


def test_checkpoint_round_trip(tmp_path):
    trainer = _trainer(tiny_path(), lr=1e-2)
    seqs = _rl_batch(tiny_path())
    trainer.train_step(seqs)
    saved = trainer.export_hf_state()
    trainer.save_checkpoint(tmp_path / "ckpt")
    m_next = trainer.train_step(seqs)
    after_next = trainer.export_hf_state()
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(v, trainer.export_hf_state()[k]) for k, v in saved.items())
    m_again = trainer.train_step(seqs)  # optimizer moments and LR schedule came back too
    assert m_again["loss"] == pytest.approx(m_next["loss"], abs=1e-7)
    assert m_again["step"] == m_next["step"]
    again = trainer.export_hf_state()
    assert max((again[k] - after_next[k]).abs().max().item() for k in again) < 1e-6
    trainer.close()
    other = _trainer(tiny_path(tie_word_embeddings=True))  # same shapes but tied: another model
    with pytest.raises(ValueError, match=r"another model .*tie_word_embeddings False in the checkpoint, True here"):
        other.load_checkpoint(tmp_path / "ckpt")
    other.close()


def test_bad_input_fails_before_any_forward_naming_the_numbers(dense):
    from megatron_bridge.batch import TrainSequence
    from megatron_bridge.model import ModelArch, UnsupportedCheckpoint, check_layout

    ok = fixed_sequences(2)
    long = TrainSequence(np.full(4000, 5), np.full(200, 6))  # 4199 inputs > the tiny model's 4096 positions
    with pytest.raises(ValueError, match=r"sequence 2 has 4000 prompt \+ 200 generated tokens = 4199 model "
                                         r"inputs, more than the trainer's context of 4096"):
        dense.compute_logprobs([*ok, long])
    with pytest.raises(ValueError, match=r"sequence 0 has token ids in \[\d+, 128\], outside .* \[0, 128\)"):
        dense.compute_logprobs([TrainSequence(np.array([5, 128]), np.array([7]))])
    dense.cfg.max_seq_len = 10  # the configured context wins over the model's
    try:
        with pytest.raises(ValueError, match="more than the trainer's context of 10"):
            dense.compute_logprobs(ok)
    finally:
        dense.cfg.max_seq_len = 0
    arch = ModelArch.from_hf_dir(tiny_path())
    with pytest.raises(UnsupportedCheckpoint, match=r"tp=3 .*vocab_size 128 is not divisible by tp=3; attention "
                                                    r"heads 4 / key-value heads 2 are not both divisible"):
        check_layout(arch, tp=3)
    with pytest.raises(UnsupportedCheckpoint, match=r"cp=2 is for dense models .* use cp=1 with Qwen3MoeForCausalLM"):
        check_layout(ModelArch.from_hf_dir(tiny_path(moe=True)), cp=2)
    with pytest.raises(UnsupportedCheckpoint, match="num_layers 2 is not divisible by pp=4"):
        _trainer(tiny_path(), pp=4)  # refused before any process group or model is built
    with pytest.raises(UnsupportedCheckpoint, match=r"MoE with tp=2 > 1 needs sequence_parallel=True and ep > 1 "
                                                    r"or etp > 1 \(got sequence_parallel=True, ep=1, etp=1\)"):
        _trainer(tiny_path(moe=True), tp=2, sequence_parallel=True)


def test_activation_recompute_changes_no_figure():
    """selective and full recompute give the step of no recompute exactly (memory: tools/bench_trainer.py)."""
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    results = {}
    for recompute in ("none", "selective", "full"):
        seqs = _rl_batch(tiny_path())
        trainer = _trainer(tiny_path(), lr=1e-2, recompute=recompute)
        assert trainer.tconfig.recompute_granularity == (None if recompute == "none" else recompute)
        m = trainer.train_step(seqs)
        results[recompute] = (m["loss"], m["grad_norm"], trainer.compute_logprobs(seqs)[0])
        trainer.close()
    for recompute in ("selective", "full"):
        assert results[recompute][:2] == pytest.approx(results["none"][:2], rel=1e-6, abs=1e-7)
        assert np.abs(results[recompute][2] - results["none"][2]).max() < 1e-6
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full"):
        MegatronTrainer(tiny_path(), TrainerConfig(recompute="some"))


def test_bf16_step_keeps_fp32_main_params_and_clips_the_gradient():
    """bf16 weights, the distributed optimizer's fp32 main params: an update below bf16's resolution is kept in
    fp32 (the bf16 weights are the main params rounded), and the gradient Adam sees is clipped to grad_clip."""
    from megatron_bridge.model import unwrap
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    seqs = _rl_batch(tiny_path(), shift=0.05)
    trainer = MegatronTrainer(tiny_path(), TrainerConfig(lr=1e-6, grad_clip=0.01, micro_batch_tokens=24),
                              dtype="bfloat16")
    model = unwrap(trainer.model)
    (opt,) = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    main = [p for g in opt.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and {p.dtype for p in main} == {torch.float32}
    before = [p.detach().clone() for p in main]
    bf16_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = trainer.train_step(seqs)
    assert np.isfinite(m["grad_norm"]) and m["grad_norm"] > 10 * 0.01
    moved = [(p - q).abs().max().item() for p, q in zip(main, before, strict=True)]
    assert min(moved) > 0  # every fp32 main param took the step
    unchanged = sum(torch.equal(p, bf16_before[n]) for n, p in model.named_parameters())
    assert unchanged > 0  # ... that some bf16 weights cannot show yet
    for p in model.parameters():  # one DP rank: each main param is its whole weight, flattened
        group, order = opt.model_param_group_index_map[p]
        assert torch.equal(p.detach().view(-1), opt.optimizer.param_groups[group]["params"][order].to(p.dtype))
    # Adam's first moment after one step is (1 - beta1) * the clipped gradient, whose norm is grad_clip
    exp_avg = torch.cat([opt.optimizer.state[p]["exp_avg"].view(-1) for p in main])
    assert exp_avg.norm().item() == pytest.approx((1 - 0.9) * 0.01, rel=1e-4)
    trainer.close()


# ------------------------------------------------------------------------------------ world size 2


def _sgd(**kw):
    # SGD: the update is linear in the gradient, so a 2-rank step equals the 1-rank step to float noise
    # (Adam's first step is ~lr * sign(g), which amplifies 1e-9 noise on near-zero gradients)
    # (Megatron-Core's distributed optimizer is Adam-only; the stack tests cover it at world size 2)
    return dict(lr=0.5, optimizer="sgd", use_distributed_optimizer=False, micro_batch_tokens=24, **kw)


@functools.cache
def _single(moe: bool, tied: bool) -> dict:
    path = tiny_path(moe=moe, tie_word_embeddings=tied)
    seqs = _rl_batch(path, moe=moe, shift=0.05)
    trainer = _trainer(path, **_sgd())
    lp, ent = trainer.compute_logprobs(seqs, replay=moe)
    before = trainer.export_hf_state()
    m = trainer.train_step(seqs)
    out = {"lp": lp, "ent": ent, "metrics": m, "before": before, "after": trainer.export_hf_state(),
           "lp_after": trainer.compute_logprobs(seqs, replay=moe)[0], "seqs": seqs}
    trainer.close()
    return out


@pytest.mark.parametrize(("layout", "moe", "tied"), [(dict(tp=2, sequence_parallel=True), False, False),
                                                     (dict(pp=2), False, True), (dict(ep=2), True, False),
                                                     (dict(tp=2, ep=2, sequence_parallel=True), True, False),
                                                     (dict(tp=2, etp=2, sequence_parallel=True), True, False),
                                                     (dict(cp=2), False, False)],
                         ids=["tp2-sp-dense", "pp2-tied", "ep2-moe-replay", "tp2-ep2-sp-moe-replay",
                              "tp2-etp2-sp-moe-replay", "cp2-dense"])
def test_world_size_2_step_equals_single_process_step(layout, moe, tied):
    from megatron_bridge.spawned import spawn_trainer
    from megatron_bridge.trainer import TrainerConfig

    ref = _single(moe, tied)
    path = tiny_path(moe=moe, tie_word_embeddings=tied)
    seqs = ref["seqs"]
    with spawn_trainer(path, TrainerConfig(**_sgd(**layout)), world_size=2, timeout_s=240) as tr:
        lp, ent = tr.compute_logprobs(seqs, replay=moe)
        before = tr.export_hf_state()
        m = tr.train_step(seqs)
        after = tr.export_hf_state()
        lp_after, _ = tr.compute_logprobs(seqs, replay=moe)
    assert np.abs(lp - ref["lp"]).max() < 1e-5 and np.abs(ent - ref["ent"]).max() < 1e-5
    assert all(torch.equal(before[k], ref["before"][k]) for k in ref["before"])  # bit-exact export, sharded
    for key in ("loss", "grad_norm", "entropy", "tis_weight_mean", "mismatch_abs_mean", "tokens"):
        assert m[key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    assert max((after[k] - ref["after"][k]).abs().max().item() for k in after) < 1e-5
    assert np.abs(lp_after - ref["lp_after"]).max() < 1e-4
    assert np.abs(lp_after - lp).max() > 1e-3  # the step did move the policy


def test_checkpoint_folders_that_are_not_this_format_are_named(tmp_path):
    import json

    from megatron_bridge.checkpoint import META_FILE, read_meta

    with pytest.raises(FileNotFoundError, match=f"is not a trainer checkpoint: it has no {META_FILE}"):
        read_meta(tmp_path)
    (tmp_path / META_FILE).write_text(json.dumps({"world_size": 1, "arch": {}}))  # the per-rank format's meta
    with pytest.raises(ValueError, match="of format 'per-rank torch.save'; this trainer reads 'megatron-core "
                                         "dist_checkpointing"):
        read_meta(tmp_path)


def test_checkpoint_written_at_tp2_loads_at_tp1(tmp_path):
    """Megatron-Core's distributed checkpoint reshards: weights, the distributed optimizer's fp32 main params and
    Adam moments, and the schedule written by 2 TP ranks continue in one process as they would have there. The
    2 ranks go through an offload/reload cycle of their memory (megatron_bridge.offload) before the second step,
    which therefore also shows that the cycle changes nothing at world size 2."""
    from megatron_bridge.spawned import spawn_trainer
    from megatron_bridge.trainer import TrainerConfig

    seqs = _rl_batch(tiny_path(), shift=0.05)
    cfg = dict(lr=1e-2, micro_batch_tokens=24)
    with spawn_trainer(tiny_path(), TrainerConfig(tp=2, **cfg), world_size=2, timeout_s=240) as tr:
        tr.train_step(seqs)
        lp, ent = tr.compute_logprobs(seqs)
        tr.save_checkpoint(tmp_path / "ckpt")
        released = tr.offload()
        assert tr.compute_logprobs(seqs)[0].tolist() == lp.tolist()  # brought back for the call only
        assert tr.reload() == {k.replace("offload", "reload"): v for k, v in released.items()}
        assert min(released.values()) > 0
        m_next = tr.train_step(seqs)
        lp_next, _ = tr.compute_logprobs(seqs)
    one = _trainer(tiny_path(), **cfg)
    fresh, _ = one.compute_logprobs(seqs)
    one.load_checkpoint(tmp_path / "ckpt")
    lp1, ent1 = one.compute_logprobs(seqs)
    assert np.abs(lp1 - lp).max() < 1e-5 and np.abs(ent1 - ent).max() < 1e-5
    assert np.abs(fresh - lp).max() > 1e-3  # the checkpoint, not the HF weights, gave these
    m1 = one.train_step(seqs)  # Adam's moments and step resharded: the same second step as at TP 2
    assert m1["step"] == m_next["step"] == 2.0
    assert m1["loss"] == pytest.approx(m_next["loss"], abs=1e-5)
    assert m1["grad_norm"] == pytest.approx(m_next["grad_norm"], rel=1e-4)
    assert np.abs(one.compute_logprobs(seqs)[0] - lp_next).max() < 1e-4
    one.close()


def test_a_full_disk_fails_the_save_on_every_rank_at_once_and_the_group_goes_on(tmp_path):
    """Two ranks save into a 256 KiB tmpfs (needs root to mount): each reserves what it will write first, so every
    rank raises the same ENOSPC at once instead of one waiting in a collective for dist_timeout_s; nothing of the
    shards is written, and the group saves elsewhere afterwards."""
    import os
    import subprocess
    import time

    from megatron_bridge.proxy import RankFailure
    from megatron_bridge.spawned import spawn_trainer
    from megatron_bridge.trainer import TrainerConfig

    full = tmp_path / "full"
    full.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        cfg = TrainerConfig(dp=2, lr=1e-2, micro_batch_tokens=24, dist_timeout_s=600)
        with spawn_trainer(tiny_path(), cfg, world_size=2, timeout_s=600) as tr:
            tr.train_step(_rl_batch(tiny_path()))  # the distributed optimizer has state to save after a step
            t0 = time.perf_counter()
            with pytest.raises(RankFailure, match="No space left on device") as info:
                tr.save_checkpoint(full / "ckpt")
            assert info.value.kind == "error" and time.perf_counter() - t0 < 120
            assert not [p for p in (full / "ckpt").rglob("*") if p.is_file()]
            tr.save_checkpoint(tmp_path / "ok")
            assert (tmp_path / "ok" / "rollverify_trainer.json").is_file()
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)


def test_loop_adapter_speaks_rollverify_responses():
    from megatron_bridge.convert import hf_tensor_names
    from megatron_bridge.loop_adapter import LoopTrainer
    from rollverify.types import Response

    trainer = _trainer(tiny_path(), lr=1e-2)
    seqs = _rl_batch(tiny_path())
    responses = []
    for i, s in enumerate(seqs):
        r = Response(group_id=0, index=i, prompt_ids=s.prompt_ids, max_new_tokens=64)
        r.append(s.gen_ids, s.rollout_logprobs, versions=0, finished=True, finish_reason="stop")
        responses.append(r)
    responses[0].versions[:3] = -1  # carried tokens of an older policy: drift, not engine/trainer mismatch
    loop = LoopTrainer(trainer, bucket_bytes=16 << 10)
    lps = loop.compute_logprobs(responses, temperature=1.0)
    assert [len(a) for a in lps] == [r.num_tokens for r in responses]
    assert max(np.abs(a - s.rollout_logprobs).max() for a, s in zip(lps, seqs, strict=True)) < 1e-4
    m = loop.train_step(responses, np.array(ADV[:len(responses)]), temperature=1.0, policy_version=0)
    assert m["tokens"] == sum(r.num_tokens for r in responses) and np.isfinite(m["loss"])
    assert (m["mismatch_tokens"], m["drift_tokens"]) == (m["tokens"] - 3, 3)
    buckets = list(loop.export_weights())
    assert len(buckets) > 1 and [n for b in buckets for n, _ in b] == hf_tensor_names(trainer.arch)
    with pytest.raises(ValueError, match="one each"):
        loop.train_step(responses, np.ones(1), temperature=1.0, policy_version=0)
    trainer.close()
