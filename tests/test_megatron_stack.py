"""Megatron-Core 0.16.1 runs on CPU through megatron_bridge.cpu_compat: forward, backward, optimizer step.

Plain Megatron-Core objects (GPTModel with the local spec, DDP, the distributed optimizer) on the tiny dense and
MoE models, at world size 1 in-process and at world size 2 (TP=2, EP=2) in spawned gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from megatron_fixtures import MARKS, stack_run, ws2_stack

pytestmark = MARKS


@pytest.fixture(scope="module")
def reference():
    """World size 1, in-process: dense and MoE."""
    return {moe: stack_run(moe=moe) for moe in (False, True)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_world_size_1_forward_backward_step(reference, moe):
    r = reference[moe]
    assert r["ok"] and torch.isfinite(torch.tensor(r["grad_norm"])) and r["grad_norm"] > 0
    assert torch.isfinite(r["logits"]).all() and r["logits"].shape == (7 + 13 + 5 - 3, 128)
    assert r["loss1"] < r["loss0"] - 1e-3, (r["loss0"], r["loss1"])


@pytest.mark.parametrize(("tp", "ep", "moe"), [(2, 1, False), (1, 2, True)], ids=["tp2-dense", "ep2-moe"])
def test_world_size_2_matches_world_size_1(reference, tp, ep, moe):
    ref = reference[moe]
    results = ws2_stack(tp, ep, moe)
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
