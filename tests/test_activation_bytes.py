"""`plan`'s activation bytes per layer against what Megatron-Core's layer really keeps for its backward.

One layer at the real Qwen3-8B shape and one Qwen3-30B-A3B MoE layer (real hidden, head and expert sizes; 16
of its 128 experts, which changes only the router's per-expert terms, evaluated for the same 16 in the
formula), 64 tokens, bf16, counted by `activation_probe` (saved-tensor hooks, each storage once, with CUDA's
fused RMSNorm's saves). Per token, per layer: `layer_activation_bytes` without recompute, minus
`selective_freed_bytes` with selective recompute, the layer's input with full recompute.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from activation_probe import layer_bytes_per_token
from megatron_fixtures import MARKS

from rollverify.app.plan import TrainerLayout, layer_activation_bytes, selective_freed_bytes
from rollverify.app.presets import ARCH_PRESETS

pytestmark = MARKS

SHAPES = {"qwen3-8b": {}, "qwen3-30b-a3b": {"num_experts": 16}}


def _arch(name: str):
    from megatron_bridge.model import ModelArch

    return replace(ModelArch.from_hf_config(ARCH_PRESETS[name]), **SHAPES[name])


def plan_bytes(arch, recompute: str) -> int:
    lay = TrainerLayout(tp=1, pp=1, dp=1, recompute=recompute)
    if recompute == "full":
        return 2 * arch.hidden_size  # the layer's input (trainer_memory adds one layer's working set once)
    freed = selective_freed_bytes(arch, lay) if recompute == "selective" else 0
    return layer_activation_bytes(arch, lay) - freed


@pytest.fixture(scope="module")
def parallel():
    from megatron_bridge.parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(), device="cpu", seed=1)


@pytest.mark.parametrize("recompute", ["none", "full", pytest.param("selective", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_holds_the_bytes_a_layer_keeps_within_10_percent(parallel, name, recompute):
    arch = _arch(name)
    measured = layer_bytes_per_token(arch, recompute, tokens=64)
    planned = plan_bytes(arch, recompute)
    print(f"{name} recompute {recompute}: measured {measured:.0f} B/token/layer, plan {planned}")
    assert planned == pytest.approx(measured, rel=0.10)

