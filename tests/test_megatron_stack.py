"""Megatron-Core 0.16.1 runs on CPU through megatron_bridge.cpu_compat: forward, backward, optimizer step.

Plain Megatron-Core objects (GPTModel with the local spec, DDP, the distributed optimizer) on the tiny dense and
MoE models, at world size 1 in-process and at world size 2 (TP=2, EP=2) in spawned gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from megatron_fixtures import SPAWN_TIMEOUT_S, fixed_tokens, quiet, tiny_path

pytestmark = pytest.mark.megatron


def _stack_run(tp: int = 1, ep: int = 1, moe: bool = False, lr: float = 1e-2) -> dict:
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
    from megatron_bridge.model import ModelArch, PackedBatch, build_model, packed_forward, transformer_config
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
    seqs = fixed_tokens(3)
    batch = PackedBatch.pack([s[:-1] for s in seqs])
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
            "logits": full[0].clone(), "tp_rank": ps.get_tensor_model_parallel_rank()}


def _ws2(rank: int, world_size: int, tp: int, ep: int, moe: bool) -> dict:
    return _stack_run(tp=tp, ep=ep, moe=moe)


@pytest.fixture(scope="module")
def reference():
    """World size 1, in-process: dense and MoE."""
    return {moe: _stack_run(moe=moe) for moe in (False, True)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_world_size_1_forward_backward_step(reference, moe):
    r = reference[moe]
    assert r["ok"] and torch.isfinite(torch.tensor(r["grad_norm"])) and r["grad_norm"] > 0
    assert torch.isfinite(r["logits"]).all() and r["logits"].shape == (7 + 13 + 5 - 3, 128)
    assert r["loss1"] < r["loss0"] - 1e-3, (r["loss0"], r["loss1"])


@pytest.mark.parametrize(("tp", "ep", "moe"), [(2, 1, False), (1, 2, True)], ids=["tp2-dense", "ep2-moe"])
def test_world_size_2_matches_world_size_1(reference, tp, ep, moe):
    from megatron_bridge.parallel import spawn

    ref = reference[moe]
    results = spawn(_ws2, 2, tp, ep, moe, timeout_s=SPAWN_TIMEOUT_S)
    for r in results:
        assert r["ok"]
        torch.testing.assert_close(r["logits"], ref["logits"], atol=1e-5, rtol=0)
        assert abs(r["loss0"] - ref["loss0"]) < 1e-5
        # the same step on the same batch: grad norm and the loss after it agree with one process
        assert abs(r["grad_norm"] - ref["grad_norm"]) < 1e-4 * max(1.0, ref["grad_norm"])
        assert abs(r["loss1"] - ref["loss1"]) < 1e-4
        assert r["loss1"] < r["loss0"]


def test_cpu_routes_leave_real_torch_alone():
    """activate() changes what Megatron-Core's modules see, not torch itself."""
    from megatron_bridge import cpu_compat

    cpu_compat.activate()
    import megatron.core.transformer.attention as attention

    assert cpu_compat.is_active()
    assert attention.torch is not torch and attention.torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is not attention.torch.cuda.current_device
    assert torch.zeros(1).device.type == "cpu" and attention.torch.zeros(1, device="cuda").device.type == "cpu"
    assert cpu_compat.needed("cpu") and (cpu_compat.needed() == (not torch.cuda.is_available()))
    with cpu_compat.cuda_type_names():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"
