"""The host-memory ledger per node (rollverify/gpu_ledger.py HostLedger, rollverify/app/host_memory.py): its
refusals, what `rollverify plan` prints and refuses for the paper configs, and a real distributed-optimizer save
at data-parallel size 2 (gloo, two processes) whose host bytes are measured against the ledger's figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollverify.app.config import load_config
from rollverify.app.host_memory import host_figures, rank_checkpoint
from rollverify.app.plan import cli_main, make_plan
from rollverify.gpu_ledger import HOST, GiB, HostLedger, HostMemoryError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PAPER = ("qwen3_8b_base", "qwen3_30b_a3b_base")


def test_a_node_over_its_limit_names_the_phase_the_node_and_every_holder():
    led = HostLedger({0: 100 * GiB, 1: 100 * GiB})
    led.enter("checkpoint")
    led.hold((1, HOST), "trainer ranks' processes (8)", 32 * GiB)
    with pytest.raises(HostMemoryError, match=r"^phase checkpoint: node 1 host RAM would hold 102\.0 GiB of its "
                       r"100\.0 GiB: trainer ranks' checkpoint gather \(2\) 70\.0 GiB, trainer ranks' processes "
                       r"\(8\) 32\.0 GiB$"):
        led.hold((1, HOST), "trainer ranks' checkpoint gather (2)", 70 * GiB)
    assert led.total((1, HOST)) == 32 * GiB and led.total((0, HOST)) == 0


def test_the_checkpoint_gather_sits_on_each_groups_first_rank():
    """Qwen3-30B-A3B's layout (tp 4, dp 8, ep 16, world 32): the dense state gathers on the ranks of data-parallel
    rank 0 (ranks 0-3), the experts' on expert-data-parallel rank 0 (ranks 0-15); without the memory-efficient
    exchange every rank gathers both; the weights are staged on the dense group's first ranks."""
    kw = dict(tp=4, cp=1, dp=8, ep=16, etp=1, world=32, pp=1, weight_bytes=2)
    dense, expert = 100, 1000
    ck = {r: rank_checkpoint(dense, expert, rank=r, mem_efficient=True, **kw) for r in range(32)}
    assert [r for r in ck if ck[r].gather == 12 * (dense + expert)] == [0, 1, 2, 3]
    assert [r for r in ck if ck[r].gather == 12 * expert] == list(range(4, 16))
    assert all(ck[r].gather == 0 and ck[r].staging == 0 for r in range(16, 32))
    assert all(ck[r].load == 12 * (dense + expert) for r in ck)  # a load fills the whole shard on every rank
    before = {r: rank_checkpoint(dense, expert, rank=r, mem_efficient=False, **kw) for r in range(32)}
    assert all(x.gather == 12 * (dense + expert) for x in before.values())


@pytest.mark.parametrize("name", PAPER)
def test_a_paper_config_stays_under_half_a_2tb_node_in_every_phase(name):
    p = make_plan(load_config(CONFIGS / f"{name}.yaml", check_task=False))
    assert p.problems == [] and p.cfg.cluster.host_memory_gib == 2048
    host = p.book.host.ledger
    peaks = {(slot[0], phase): peak.nbytes for phase, by_slot in host.peaks.items() for slot, peak in by_slot.items()}
    assert len({n for n, _ in peaks}) == 4 and {"checkpoint", "restore", "rollout", "train"} <= {x for _, x in peaks}
    assert max(peaks.values()) < 1024 * GiB, max(peaks.items(), key=lambda kv: kv[1])
    # the checkpoint's gather is on the nodes of the data-parallel groups' first ranks, the load on every node
    restore = {n: b for (n, phase), b in peaks.items() if phase == "restore"}
    rollout = {n: b for (n, phase), b in peaks.items() if phase == "rollout"}
    assert all(restore[n] > rollout[n] + 64 * GiB for n in restore)
    # Megatron-Core's default exchange (every rank gathers) would hold more in the checkpoint phase
    from rollverify.app.host_memory import HostBook

    default = HostBook(p, strict=False, mem_efficient=False)
    assert sum(x.gather for x in default.figures.checkpoint.values()) > \
        2 * sum(x.gather for x in p.book.host.figures.checkpoint.values())
    table = p.table()
    assert "host RAM per node by phase (GiB of 2048" in table and "highest: node " in table


def test_the_offloaded_copies_stay_on_the_host_until_every_kind_is_back():
    """A reload empties torch's host cache after its last kind (megatron_bridge.offload), so the train phase's
    peak holds every rank's offloaded parameters and optimizer state at once, whichever order the book keeps
    its kinds in."""
    p = make_plan(load_config(CONFIGS / "qwen3_8b_base.yaml", check_task=False))
    host = p.book.host.ledger
    train = dict(host.peaks["train"][host.node(1)].holders)
    assert train["trainer ranks' offloaded params (8)"] == 8 * p.book.host.figures.offload["params"]
    assert train["trainer ranks' offloaded optimizer (8)"] == 8 * p.book.host.figures.offload["optimizer"]


def test_plan_refuses_a_layout_over_the_nodes_ram(capsys):
    """A node whose RAM the load of a checkpoint overfills (every rank fills its model-parallel shard's whole
    optimizer state): refused before anything starts, naming the phase, the node, the holders and the fix."""
    assert cli_main(["--config", str(CONFIGS / "qwen3_8b_base.yaml"), "cluster.host_memory_gib=256"]) == 2
    out = capsys.readouterr().out
    assert "DOES NOT FIT: phase restore: node 0 host RAM would hold" in out
    assert "trainer ranks' checkpoint load (8)" in out and "cluster.host_memory_gib 256" in out
    assert "raise trainer.tp/pp/ep" in out


# --- a real save at data-parallel size 2 -------------------------------------------------------------------------

SPEC = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=64)


def _heap() -> int:
    """Bytes this process has allocated from the C heap now (glibc's mallinfo2: in-use arena + mmapped blocks;
    torch's CPU tensors live there)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = MallInfo2
    m = fn()
    return m.uordblks + m.hblkhd


def _save_rank(rank: int, world: int, port: int, model: str, out: str, results) -> None:
    """One rank: a trainer at dp 2 steps once, then saves. Megatron-Core's gather (`get_parameter_state_dp_zero`)
    is wrapped to read the heap around every collective and concatenation it makes (its buffers' high points,
    read at fixed points of its code, not by a sampler racing it) and when it returns."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        import gc

        import numpy as np
        import torch
        import torch.distributed as tdist

        torch.set_num_threads(1)
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        from megatron_bridge.batch import TrainSequence
        from megatron_bridge.trainer import MegatronTrainer, TrainerConfig
        from rollverify.losses import CorrectionConfig

        trainer = MegatronTrainer(model, TrainerConfig(dp=2, lr=1e-3, micro_batch_tokens=64,
                                                       correction=CorrectionConfig(method="none")))
        rng = np.random.default_rng(0)
        trainer.train_step([TrainSequence(rng.integers(4, 4000, 8), rng.integers(4, 4000, 8), advantage=a)
                            for a in (1.0, -1.0, 0.5, -0.5)])
        probes: list[int] = []
        got: dict[str, int] = {}
        gather = DistributedOptimizer.get_parameter_state_dp_zero

        def probed(fn):
            def call(*a, **k):
                probes.append(_heap())
                out = fn(*a, **k)
                probes.append(_heap())
                return out

            return call

        def measured(self, *a, **k):
            real = torch.cat, tdist.gather, tdist.all_gather
            torch.cat, tdist.gather, tdist.all_gather = (probed(f) for f in real)
            try:
                state = gather(self, *a, **k)
            finally:
                torch.cat, tdist.gather, tdist.all_gather = real
            got["gather_peak"], got["after_gather"], got["probes"] = max(probes), _heap(), len(probes)
            got["returned"] = sum(t.nbytes for g in (state or {}).values() if isinstance(g, dict)
                                  for by_dtype in g.values() for t in by_dtype.values() if torch.is_tensor(t))
            return state

        DistributedOptimizer.get_parameter_state_dp_zero = measured
        gc.collect()
        base = _heap()
        trainer.save_checkpoint(out)
        gc.collect()
        after = _heap()
        params = sum(b.numel_unpadded for b in trainer.model.buffers)
        results.put((rank, {"params": params, "returned": got["returned"], "held": got["after_gather"] - base,
                            "gather_peak": got["gather_peak"] - base, "after_save": after - base,
                            "probes": got["probes"]}))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        results.put((rank, {"error": f"{e}\n{traceback.format_exc()}"}))


@pytest.mark.slow  # two Megatron-Core ranks start and save: ~60 s idle, 150 s at load 37
@pytest.mark.megatron
def test_a_dp2_save_holds_on_the_host_what_the_ledger_counts(tmp_path):
    """Two gloo ranks of one data-parallel group save the distributed optimizer the way `megatron_bridge.checkpoint`
    does (memory-efficient exchange): the group's rank 0 holds the gathered fp32 state, 12 bytes a parameter, for
    the save and peaks at that plus one bucket's buffers; rank 1 holds nothing beyond its local shards. The
    ledger's figures (`host_figures` of the same model's plan at dp 2) come within a few per cent of both."""
    import multiprocessing as mp

    from megatron_bridge.parallel import free_port
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

    model = str(ensure_tiny_model(TinyModelSpec(**SPEC)))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # not daemonic: Megatron-Core's writer forks its writer processes from each rank
    procs = [ctx.Process(target=_save_rank, args=(r, 2, port, model, str(tmp_path / "ckpt"), results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert not any("error" in x for x in got.values()), got
    plan = make_plan(load_config(None, [f"model.tiny_overrides={json.dumps(SPEC)}", "model.task=null",
                                        "trainer.dp=2"], check_task=False))
    ck = host_figures(plan).checkpoint
    params = got[0]["params"]
    assert params == got[1]["params"] == plan.trainer.weights // 2  # the plan counts the buffer's parameters
    root, other = got[0], got[1]
    assert root["returned"] == ck[0].gather == 12 * params  # the gathered fp32 param + two moments, exactly
    assert abs(root["held"] - ck[0].gather) < 0.02 * ck[0].gather  # what the heap holds after the gather
    assert abs(root["gather_peak"] - (ck[0].gather + ck[0].buffers)) < 0.05 * ck[0].gather
    assert other["returned"] == ck[1].gather == 0 and other["held"] < 0.01 * ck[0].gather
    assert abs(other["gather_peak"] - ck[1].buffers) < 0.05 * ck[1].buffers
    # the gathered state goes with the save: nothing of it stays on the host after
    assert root["probes"] >= 6 and root["after_save"] < 0.05 * ck[0].gather and other["after_save"] < 0.05 * ck[0].gather
    print(f"dp-2 save, {params} parameters: rank 0 held {root['held'] / 2**20:.1f} MiB (ledger "
          f"{ck[0].gather / 2**20:.1f}), peak {root['gather_peak'] / 2**20:.1f} MiB (ledger "
          f"{(ck[0].gather + ck[0].buffers) / 2**20:.1f}); rank 1 peak {other['gather_peak'] / 2**20:.1f} MiB (ledger "
          f"{ck[1].buffers / 2**20:.1f})")
