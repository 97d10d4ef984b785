"""`rollverify plan`: placement and per-GPU memory of every shipped config, and the configs it must refuse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollverify.app.config import ConfigError, load_config
from rollverify.app.plan import (
    ARCH_PRESETS,
    GiB,
    PlanError,
    TrainerLayout,
    cli_main,
    layer_activation_bytes,
    make_plan,
    model_arch,
    total_params,
    trainer_memory,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def plan_of(name: str, *overrides: str):
    return make_plan(load_config(CONFIGS / f"{name}.yaml", list(overrides), check_task=False))


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_is_planned(name):
    p = plan_of(name)
    assert p.problems == [], p.problems
    c = p.cfg.cluster
    # every trainer rank has its own GPU (or CPU slot), every server its own GPUs, none across nodes
    assert len(p.ranks) == p.cfg.trainer.world_size
    if c.gpus_per_node:
        assert len(set(p.ranks)) == len(p.ranks)
        used = [(s.node, g) for s in p.servers for g in s.gpus]
        assert len(set(used)) == len(used) == len(p.servers) * p.gpus_per_server
        assert all(0 <= g < c.gpus_per_node and 0 <= n < c.nodes for n, g in used + p.ranks)
    assert "placement" in p.table() and ("fits" in p.table()) == (not p.problems)


def test_paper_8b_placement_and_memory():
    p = plan_of("qwen3_8b_base")
    assert p.ranks[:9] == [(0, g) for g in range(8)] + [(1, 0)] and p.ranks[31] == (3, 7)
    assert [(s.node, s.gpus) for s in p.servers[:5]] == [(0, [0, 1]), (0, [2, 3]), (0, [4, 5]), (0, [6, 7]),
                                                         (1, [0, 1])]
    a = p.arch
    # Qwen3-8B: embedding + untied head, 36 x (q,k,v,o + SwiGLU + norms), final norm
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert total_params(a) == 2 * 151936 * 4096 + 36 * layer + 4096
    t, s = p.trainer, p.server
    per_rank = total_params(a) // 2  # tp 2 (norms are replicated: within a few kB)
    assert abs(t.weights - 2 * per_rank) < 1e6 and t.gradients == 2 * t.weights
    assert abs(t.optimizer - 12 * per_rank / 16) < 1e6  # distributed optimizer over dp 16
    # full recompute: every layer's input (bf16, split over TP by SP) + one layer's working set
    assert p.layout.sequence_parallel and p.layout.recompute == "full"
    assert t.activations == 32768 * (36 * 2 * 4096 // 2 + layer_activation_bytes(a, p.layout))
    # SGLang KV per token per GPU at tp 2: 2 (K and V) x 36 layers x 4 KV heads x 128 x 2 bytes
    assert s.kv_bytes_per_token == 2 * 36 * 4 * 128 * 2 and s.live_per_server == 24
    assert s.kv_needed_tokens == 24 * 32768 <= s.kv_pool_tokens
    assert t.total + 3 * GiB < 79.6 * GiB


# the margin docs/cluster.md states for each paper config: what its fullest GPU keeps free in its fullest phase
# (the rollout: a server's context, static share and SGLang's runtime share beside the trainer rank's context)
STATED_MARGIN_GIB = {"qwen3_8b_base": 0.9, "qwen3_30b_a3b_base": 0.5}


@pytest.mark.parametrize("name", sorted(STATED_MARGIN_GIB))
def test_a_paper_config_keeps_its_stated_margin_with_a_restore_beside_generating_servers(name):
    p = plan_of(name)
    book = p.book
    rollout = max(peak.nbytes for peak in book.ledger.peaks["rollout"].values())
    # the replay restores a restarted server during the rollout: deferred, the trainer's parameters never come
    # back beside the servers' KV pools
    for peak in book.ledger.peaks["rollout"].values():
        held = [h for h, b in peak.holders if b]
        assert any(h.endswith("kv_cache") for h in held) and not any(h.endswith(" params") for h in held), held
    assert book.margin() == min(book.ledger.capacity.values()) - max(
        peak.nbytes for peaks in book.ledger.peaks.values() for peak in peaks.values())
    assert rollout == max(peak.nbytes for peaks in book.ledger.peaks.values() for peak in peaks.values())
    assert round(book.margin() / GiB, 1) >= STATED_MARGIN_GIB[name]
    assert f"margin: {book.margin() / GiB:.1f} GiB" in p.table()


def test_memory_formulas_respond_to_the_layout():
    a = model_arch(load_config(CONFIGS / "qwen3_8b_base.yaml", check_task=False))
    base = TrainerLayout(tp=2, pp=1, dp=16, micro_batch_tokens=32768)
    m = trainer_memory(a, base, 32768)
    per_layer = layer_activation_bytes(a, base)
    # without SP the norm and linear inputs (4h bf16) stay whole on every TP rank; SP splits them
    sp = TrainerLayout(tp=2, pp=1, dp=16, sequence_parallel=True)
    assert per_layer - layer_activation_bytes(a, sp) == (8 * 4096 + 8) // 2
    assert m.activations == 32768 * 36 * per_layer
    full = trainer_memory(a, TrainerLayout(tp=2, pp=1, dp=16, recompute="full", micro_batch_tokens=32768), 32768)
    assert full.activations == 32768 * (36 * 2 * 4096 + per_layer) < m.activations / 5
    cp = trainer_memory(a, TrainerLayout(tp=2, pp=1, dp=8, cp=2, micro_batch_tokens=32768), 32768)
    assert cp.tokens == 16384 and cp.optimizer == m.optimizer  # dp*cp shards the optimizer alike
    assert trainer_memory(a, TrainerLayout(tp=2, pp=1, dp=8, micro_batch_tokens=32768), 32768).optimizer == \
        pytest.approx(2 * m.optimizer, rel=1e-6)
    # the run config's trainer options reach the plan: without SP each layer's input is whole on every TP rank
    no_sp = plan_of("qwen3_8b_base", "trainer.sequence_parallel=false")
    assert not no_sp.layout.sequence_parallel and no_sp.trainer.activations == 32768 * (
        36 * 2 * 4096 + layer_activation_bytes(a, no_sp.layout))
    # a longer context than micro_batch_tokens sizes the micro-batch
    assert trainer_memory(a, TrainerLayout(tp=2, pp=1, dp=16, micro_batch_tokens=4096), 32768).tokens == 32768


def test_moe_counts_experts_over_ep():
    p = plan_of("qwen3_30b_a3b_base", "trainer.tp=1", "trainer.dp=32", "trainer.ep=8", "trainer.sequence_parallel=false")
    total = total_params(p.arch)
    assert abs(total / 1e9 - 30.5) < 0.1  # Qwen3-30B-A3B
    experts = 48 * 3 * 2048 * 768 * 128
    # tp 1: every dense weight on each GPU, 16 of the 128 experts (ep 8); the distributed optimizer shards the
    # dense state over dp 32 and the expert state over the expert-data-parallel group (32 / ep 8 = 4)
    assert p.trainer.weights == 2 * (total - experts + experts // 8)
    assert p.trainer.optimizer == 12 * (total - experts) // 32 + 12 * (experts // 8) // 4
    # 4 KV heads on a tp 4 server: one head a GPU
    assert p.server.kv_bytes_per_token == 2 * 48 * 1 * 128 * 2


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("qwen3_8b_base", ["trainer.dp=32"], r"trainer world size 64 \(tp\*pp\*cp\*dp\) is larger than the GPUs = 32"),
        (
            "qwen3_30b_a3b_base",
            ["trainer.sequence_parallel=false"],
            r"trainer\.tp = 4: the trainer runs MoE under TP only with trainer\.sequence_parallel=true",
        ),
        ("qwen3_30b_a3b_base", ["trainer.tp=8", "trainer.dp=4"], r"key-value heads 4 are not both divisible by tp=8"),
        (
            "qwen3_30b_a3b_base",
            ["trainer.tp=1", "trainer.dp=32", "trainer.ep=8", "trainer.sequence_parallel=false",
             "trainer.recompute=none"],
            r"phase train: node 0 GPU 0 would hold 292\.3 GiB of its 79\.6 GiB: .*trainer rank 0 activations 249\.8 "
            r"GiB.*activations dominate .*set trainer\.recompute=full",
        ),
        (
            "qwen3_8b_base",
            ["rollout.max_live=2048", "servers.engine_args.max_running_requests=256"],
            r"KV cache: a server must hold 135 live responses x 32768 tokens = 4423680 tokens, its pool holds "
            r"\d+ .*set servers\.engine_args\.max_running_requests to 24",
        ),
        ("qwen3_8b_base", ["servers.count=20"], r"20 servers x 2 GPUs = 40 GPUs, more than the 32 GPUs"),
        ("qwen3_8b_base", ["trainer.tp=16", "trainer.dp=2"], r"key-value heads 8 are not both divisible by tp=16"),
        ("tiny_cpu", ["trainer.tp=3"], r"attention heads 4 / key-value heads 2 are not both divisible by tp=3"),
        ("qwen3_8b_base", ["trainer.recompute=none"], r"activations dominate .*set trainer\.recompute=full"),
        ("qwen3_8b_base", ["rollout.max_new_tokens=32768"], r"max_new_tokens = 32768 leaves no room for a prompt"),
        ("qwen3_8b_base", ["servers.engine_args.dp_size=2"], r"engine_args\.dp_size = 2: a server's weight updates"),
        (
            "qwen3_8b_base",
            ["trainer.offload_between_phases=false"],
            r"phase rollout: node 0 GPU 0 would hold 91\.2 GiB .*server 0 kv_cache 54\.9 GiB.*trainer rank 0 "
            r"optimizer 2\.9 GiB.*offload_between_phases=null",
        ),
    ],
)
def test_broken_variants_are_refused_by_the_cli(name, overrides, message, capsys):
    assert cli_main(["--config", str(CONFIGS / f"{name}.yaml"), *overrides]) == 2
    out = capsys.readouterr()
    assert any(re.search(message, x) for x in (out.out, out.err)), out


def test_disaggregated_and_cpu_cluster_placement():
    p = plan_of("qwen3_8b_base", "cluster.placement=disaggregated", "cluster.rollout_gpus=16", "trainer.dp=8",
                "servers.count=8", "rollout.max_live=192")
    assert p.problems == [] and p.ranks[-1] == (1, 7)
    assert [(s.node, s.gpus[0]) for s in p.servers] == [(2, 0), (2, 2), (2, 4), (2, 6), (3, 0), (3, 2), (3, 4),
                                                        (3, 6)]
    # two simulated CPU nodes (the Ray test's layout): one rank and one server on each
    q = plan_of("tiny_cpu", "cluster.launcher=ray", "cluster.nodes=2", "trainer.dp=2", "servers.count=2")
    assert q.ranks == [(0, None), (1, None)] and [s.node for s in q.servers] == [0, 1]
    # servers someone else runs are not placed nor sized here
    e = plan_of("qwen3_8b_base", "servers.endpoints=[tcp://10.0.0.1:5555]", "rollout.max_live=4096")
    assert e.servers == [] and e.problems == [] and "not checked" in e.notes[0]


def test_architecture_sources(tmp_path):
    # config.json beside the weights wins; a stated model.arch must agree with it
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**ARCH_PRESETS["qwen3-8b"], "num_hidden_layers": 2}))
    p = plan_of("qwen3_8b_base", f"model.path={folder}", "model.arch=null")
    assert p.arch.num_layers == 2
    with pytest.raises(PlanError, match=r"model\.arch .* differs from .*config\.json"):
        plan_of("qwen3_8b_base", f"model.path={folder}")
    with pytest.raises(PlanError, match=r"has no config\.json on this machine: set model\.arch"):
        plan_of("qwen3_8b_base", "model.arch=null")
    dims = {**ARCH_PRESETS["qwen3-8b"], "num_hidden_layers": 4}
    explicit = plan_of("qwen3_8b_base", "model.arch=" + json.dumps(dims))
    assert explicit.arch.num_layers == 4 and explicit.arch.hidden_size == 4096
    with pytest.raises(PlanError, match=r"model\.arch: not a usable architecture .*LlamaForCausalLM"):
        plan_of("qwen3_8b_base", 'model.arch={"architectures": ["LlamaForCausalLM"]}')


def test_cluster_keys_that_contradict_each_other():
    with pytest.raises(ConfigError, match=r"cluster\.nodes: the local launcher runs on this machine only"):
        load_config(None, ["cluster.nodes=2"])
    with pytest.raises(ConfigError, match=r"cluster\.rollout_gpus: colocated servers share every GPU"):
        load_config(None, ["cluster.gpus_per_node=8", "cluster.rollout_gpus=4"])
    with pytest.raises(ConfigError, match=r"0 < rollout_gpus < nodes\*gpus_per_node = 8, got 8"):
        load_config(None, ["cluster.gpus_per_node=8", "cluster.placement=disaggregated", "cluster.rollout_gpus=8"])
    with pytest.raises(ConfigError, match=r"model\.arch: unknown preset 'qwen3-8B' \(did you mean 'qwen3-8b'\?\)"):
        load_config(None, ["model.path=/m", "model.arch=qwen3-8B"])


@pytest.mark.parametrize("overrides, message", [
    (["trainer.dp=32"], "trainer world size 64"),
    # a phase that overfills a GPU: named with its GPU and holders before any server or rank starts
    (["trainer.offload_between_phases=false"], r"phase rollout: node 0 GPU 0 would hold 91\.2 GiB of its 79\.6 GiB: "
     r"server 0 context 1\.5 GiB, .*trainer rank 0 params 7\.6 GiB"),
])
def test_train_checks_the_plan_before_it_writes_anything(tmp_path, overrides, message):
    from rollverify.app.train import train

    cfg = load_config(CONFIGS / "qwen3_8b_base.yaml", overrides, check_task=False)
    with pytest.raises(PlanError, match=message):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
