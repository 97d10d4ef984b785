"""Weight sync: HF-named buckets with a version; after a sync the engine computes the trainer's log-probs.

The engine here is transformers (in-process tensors and a disk folder), and, marked `engine`/`slow`, a real
SGLang 0.5.23 engine on CPU loading the exported folder with `update_weights_from_disk`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = MARKS

GENS = (12, 20, 9, 16)


def _stepped_trainer(moe: bool):
    """A trainer one Adam step away from the checkpoint (so a sync carries new weights)."""
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    path = tiny_path(moe=moe)
    trainer = MegatronTrainer(path, TrainerConfig(lr=2e-2, micro_batch_tokens=64))
    seqs = fixed_sequences(4, gens=GENS)
    lps, routes = hf_token_logprobs(path, seqs, with_routes=moe)
    for i, s in enumerate(seqs):
        s.rollout_logprobs, s.advantage = lps[i], (1.0, -1.0, 0.5, -0.5)[i]
        s.routed_experts = routes[i] if moe else None
    before, _ = trainer.compute_logprobs(seqs, replay=moe)
    trainer.train_step(seqs)
    return trainer, seqs, before


def _as_checkpoint(src, state, out):
    """The synced tensors as a checkpoint folder transformers loads (it regroups MoE experts on load)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-replay"])
def test_sync_then_engine_logprobs_equal_trainer_logprobs(moe, tmp_path):
    from megatron_bridge.weight_sync import InMemorySink

    trainer, seqs, before = _stepped_trainer(moe)
    sink = InMemorySink()
    stats = trainer.sync_weights(sink, version=7, bucket_bytes=64 << 10)
    assert sink.version == 7 and sink.buckets == stats["sync_buckets"] > 1
    assert stats["sync_bytes"] == sum(t.numel() * 4 for t in sink.state.values())
    engine = _as_checkpoint(tiny_path(moe=moe), sink.state, tmp_path / "engine")
    engine_lp, routes = hf_token_logprobs(engine, seqs, with_routes=moe)
    if moe:  # R3: the trainer replays the engine's routes of this very forward
        for s, r in zip(seqs, routes, strict=True):
            s.routed_experts = r
    trainer_lp, _ = trainer.compute_logprobs(seqs, replay=moe)
    engine_lp = np.concatenate(engine_lp)
    assert np.abs(engine_lp - trainer_lp).max() < 1e-4
    assert np.abs(trainer_lp - before).max() > 1e-3  # the sync carried the new policy, not the old one
    trainer.close()


def test_disk_sink_writes_a_checkpoint_both_sides_load(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_bridge.convert import iter_hf_tensors, load_hf_checkpoint
    from megatron_bridge.model import ModelArch, build_model, transformer_config
    from megatron_bridge.weight_sync import DiskSink, InMemorySink

    trainer, _, _ = _stepped_trainer(False)
    out = tmp_path / "v3"
    trainer.sync_weights(DiskSink(out, tiny_path()), version=3, bucket_bytes=32 << 10)
    mem = InMemorySink()
    trainer.sync_weights(mem, version=3)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "config.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(v, mem.state[k]) for k, v in hf.state_dict().items() if k in mem.state)
    # and the trainer's own loader reads the sharded folder back bit-exactly
    arch = ModelArch.from_hf_dir(out)
    model = build_model(arch, transformer_config(arch))
    load_hf_checkpoint(model, out)
    assert all(torch.equal(v, mem.state[k]) for k, v in iter_hf_tensors(model, arch))
    trainer.close()


def test_ipc_payload_round_trip():
    """CPU tensors stand for CUDA ones here; they travel as file descriptors (torch's default strategy), which
    never wait on torch's shared-memory manager as the file_system strategy's do (tests/test_shm_handshake.py)."""
    import torch.multiprocessing as tmp

    from megatron_bridge.weight_sync import ipc_handles, load_ipc_handles

    bucket = [("x", torch.randn(4, 3)), ("y", torch.arange(5))]
    saved = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_descriptor")
    try:
        got = load_ipc_handles(ipc_handles(bucket))
    finally:
        tmp.set_sharing_strategy(saved)
    assert [n for n, _ in got] == ["x", "y"] and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, bucket,
                                                                                                  strict=True))


# ------------------------------------------------------------------------------------ real SGLang engine


def _engine_worker(model_path: str, new_path: str, inputs: list[list[int]], moe: bool, q) -> None:
    """In a fresh process: serve `model_path`, read input-token log-probs (and routes), load `new_path` from
    disk, read them again."""
    import base64

    from sglang_ext import cpu_compat

    cpu_compat.activate()
    import sglang as sgl

    eng = sgl.Engine(model_path=model_path,
                     **cpu_compat.engine_kwargs(enable_return_routed_experts=moe, log_level="error"))

    def read():
        lps, routes = [], []
        for ids in inputs:
            out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               return_logprob=True, logprob_start_len=0, return_routed_experts=moe)
            mi = out["meta_info"]
            lps.append(np.array([x[0] for x in mi["input_token_logprobs"][1:]], np.float32))
            if moe:
                r = np.frombuffer(base64.b64decode(mi["routed_experts"]), dtype=np.int32)
                routes.append(r.reshape(len(ids), -1, 2))  # [prompt + 1 output - 1, layers, top_k]
        return lps, routes

    try:
        first = read()
        ok, msg, *_ = eng.update_weights_from_disk(new_path)
        second = read() if ok else None
        q.put(("ok", first, second, msg))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e), None, None))
    finally:
        eng.shutdown()


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-replay"])
def test_sglang_engine_after_update_from_disk_matches_trainer(moe, tmp_path):
    import torch.multiprocessing as mp

    pytest.importorskip("sglang")
    from megatron_bridge.weight_sync import DiskSink

    trainer, seqs, before = _stepped_trainer(moe)
    trainer.sync_weights(DiskSink(tmp_path / "v1", tiny_path(moe=moe)), version=1)
    inputs = [np.concatenate([s.prompt_ids, s.gen_ids]).tolist() for s in seqs]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_engine_worker, args=(str(tiny_path(moe=moe)), str(tmp_path / "v1"), inputs, moe, q))
    proc.start()  # not a daemon: SGLang starts its own children
    try:
        status, first, second, msg = q.get(timeout=420)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok" and second is not None, (first, msg)

    def engine_lp(result):
        # input-token log-probs of positions 1..; the generated tokens are the last G of them
        return np.concatenate([lp[s.prompt_ids.size - 1:] for lp, s in zip(result[0], seqs, strict=True)])

    def trainer_lp(result):
        if moe:
            for s, r in zip(seqs, result[1], strict=True):
                s.routed_experts = r[:s.num_inputs]
        return trainer.compute_logprobs(seqs, replay=moe)[0]

    after = trainer_lp(second)
    assert np.abs(engine_lp(second) - after).max() < 1e-4
    assert np.abs(engine_lp(first) - before).max() < 1e-4  # and before the update, the old policy
    assert np.abs(after - before).max() > 1e-3
    trainer.close()
