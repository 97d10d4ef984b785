"""The GPU memory ledger (rollverify/gpu_ledger.py) and the run's start-up and phase order on it.

The paper configs' launch runs `rollverify train`'s own `Run` (rollverify/app/train.py: plan placement, the
book of every GPU, `start_run`, the Ray layout's IPC transport and its handoff, the loop's trainer, checkpoint,
export and restore) with the wings' entry points replaced by stand-ins that do no compute (`DryWings`): the
ledger is the fake device, recording the paper model's bytes (the plan's figures) on the plan's 32 GPUs, and
the stand-ins record the order of the calls that the handoff makes. The real wings' calls are exercised on the
tiny model by tests/test_weight_transport.py, which also holds its ledger.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rollverify.app.config import load_config
from rollverify.gpu_ledger import GiB, GpuLedger, GpuMemoryError
from sglang_ext.rollout_engine import DEFERRED

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_a_hold_beyond_the_gpu_names_the_phase_the_gpu_and_every_holder():
    led = GpuLedger({(0, 0): 10 * GiB, (1, 3): 10 * GiB})
    led.enter("train")
    led.hold((1, 3), "server 0 weights", 4 * GiB)
    led.hold((1, 3), "trainer rank 11 params", 5 * GiB)
    with pytest.raises(GpuMemoryError, match=r"^phase train: node 1 GPU 3 would hold 11\.0 GiB of its 10\.0 GiB: "
                       r"server 0 weights 4\.0 GiB, trainer rank 11 activations 2\.0 GiB, trainer rank 11 params "
                       r"5\.0 GiB$"):
        led.hold((1, 3), "trainer rank 11 activations", 2 * GiB)
    assert led.total((1, 3)) == 9 * GiB and led.total((0, 0)) == 0  # the refused entry is not kept
    led.hold((1, 3), "trainer rank 11 params", 6 * GiB)  # an entry replaces the holder's bytes: 10 GiB fits
    led.drop((1, 3), "server 0 weights")
    assert led.holders((1, 3)) == {"trainer rank 11 params": 6 * GiB}
    lenient = GpuLedger({(0, 0): GiB}, strict=False)
    lenient.hold((0, 0), "a", 2 * GiB)
    assert lenient.total((0, 0)) == 2 * GiB and "phase start: node 0 GPU 0 would hold 2.0 GiB" in lenient.overflows[0]


def test_a_phase_peak_is_its_highest_entry_or_what_it_held_through():
    led = GpuLedger({(0, 0): 80 * GiB})
    led.hold((0, 0), "server 0 kv_cache", 60 * GiB)
    led.enter("train")
    led.drop((0, 0), "server 0 kv_cache")
    led.hold((0, 0), "trainer rank 0 activations", 30 * GiB)
    led.hold((0, 0), "trainer rank 0 grads", 10 * GiB)
    led.drop((0, 0), "trainer rank 0 activations")
    led.enter("rollout")  # no entry in this phase: what the slot held through it
    led.settle()
    assert {p: led.peaks[p][(0, 0)].nbytes // GiB for p in ("start", "train", "rollout")} == {
        "start": 60, "train": 40, "rollout": 10}
    assert dict(led.peaks["train"][(0, 0)].holders) == {"trainer rank 0 activations": 30 * GiB,
                                                        "trainer rank 0 grads": 10 * GiB}


def test_a_measurement_above_the_ledger_warns_once_a_phase_with_both_numbers():
    said: list[str] = []
    led = GpuLedger({(0, 2): 80 * GiB}, margin=GiB, warn=said.append)
    led.enter("train")
    led.hold((0, 2), "trainer rank 2 params", 10 * GiB)
    assert not led.compare((0, 2), int(10.5 * GiB))  # within the margin
    assert led.compare((0, 2), 12 * GiB)
    assert not led.compare((0, 2), 13 * GiB)  # once a phase
    assert said == ["GPU memory ledger, phase train, node 0 GPU 2: measured 12.0 GiB, the ledger counts 10.0 GiB "
                    "(2.0 GiB more than its margin of 1.0 GiB allows): trainer rank 2 params 10.0 GiB"]
    led.enter("sync")
    assert led.compare((0, 2), 13 * GiB, counted=0, what="in use") and "phase sync" in said[-1]


# --- the paper configs' launch through rollverify train's Run ---------------------------------------------------


class DryWings:
    """Stand-ins for what the wings start (servers, trainer ranks) and what reaches them (memory calls, weight
    pushes, checkpoints): they do nothing and log the call; the servers record themselves on the run's book
    where `RayServerLauncher.launch_many` does."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.paused = True

    # the Ray cluster and the two wings' starts (rollverify.app.train.Run's calls)
    def cluster(self, plan, paths, shared=None):
        return SimpleNamespace(plan=plan, nodes=range(plan.cfg.cluster.nodes), node_name=str, close=lambda: None,
                               remove_on_every_node=lambda folders: None)

    def start_engine(self, cfg, cluster, model_path, log_dir, book):
        from sglang_ext.pool import ServerAddress

        self.addresses = [ServerAddress(s.index, f"tcp://dry:{s.index}", None) for s in cluster.plan.servers]
        for s in cluster.plan.servers:
            book.server_started(s.index)
        self.log.append("servers started")
        return self

    def start_trainer(self, model_path, cfg, cluster, **kw):
        self.log.append("trainer built")
        return self

    def servers_memory(self, engine, timeout_s):
        return self

    # engine
    def live_servers(self):
        return self.addresses

    def committed(self, version):
        self.log.append(f"servers serve v{version}")

    def restart_weights(self, source=None, restore=None):
        self.restore = restore or getattr(self, "restore", None)  # how a restarted server gets the policy

    def close(self, shutdown=True):
        pass

    def pause(self):
        self.paused = True

    def wait_finished(self, timeout_s):
        return []

    def response_ids(self):
        return []

    ranks = None  # the trainer proxy's rank group: none to kill here

    # server side of the handoff
    def memory(self, action, tags):
        self.log.append(f"servers {action} {','.join(tags)}")

    # trainer (behind LoopTrainer)
    def offload(self, kinds):
        self.log.append(f"trainer offload {','.join(kinds)}")
        return {}

    def reload(self, kinds=None):
        self.log.append("trainer reload")
        return {}

    def send_weights(self, spec, version, bucket_bytes):
        self.log.append(f"send {spec.kind} v{version} to {len(spec.endpoints)} servers")
        return {}

    def train_step(self, seqs, **kw):
        self.log.append("train_step")
        return {}

    def memory_report(self):
        return {}  # what a rank off CUDA reports: nothing to hold against the ledger

    def save_checkpoint(self, path):
        self.log.append("save")

    def load_checkpoint(self, path):
        self.log.append("load")

    def export_hf_state(self, out_dir):
        Path(out_dir).mkdir(parents=True)
        self.log.append("export")


@pytest.fixture()
def dry_run(monkeypatch, tmp_path):
    """`Run(cfg, out)` of a paper config (task swapped for the synthetic one: its data files are not here) on
    `DryWings`; yields (run, wings)."""
    import rollverify.app.cluster as cluster
    import rollverify.app.ray_placement as placement
    import rollverify.app.train as train
    import rollverify.app.weight_transport as transport
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

    wings = DryWings()
    tiny = ensure_tiny_model(TinyModelSpec())  # the tokenizer the run reads
    monkeypatch.setattr(train, "resolve_model", lambda cfg: tiny)
    monkeypatch.setattr(cluster.RayCluster, "start", staticmethod(wings.cluster))
    monkeypatch.setattr(placement, "start_ray_engine", wings.start_engine)
    monkeypatch.setattr(placement, "start_ray_trainer", wings.start_trainer)
    monkeypatch.setattr(transport, "ServersMemory", wings.servers_memory)
    runs = []

    def make(name: str):
        cfg = load_config(CONFIGS / f"{name}.yaml", ["task.name=countdown", "task.options={}", "eval.every=0"])
        runs.append(train.Run(cfg, tmp_path / name))
        return runs[-1], wings

    yield make
    for r in runs:
        r.close()


START = ["servers started", "servers release weights,kv_cache,cuda_graph", "trainer built",
         "trainer offload params,grads,optimizer", "trainer offload grads,optimizer", "servers resume weights",
         "send ipc v0 to {n} servers", "servers serve v0", "trainer offload params",
         "servers resume kv_cache,cuda_graph"]


@pytest.mark.parametrize("name", ["qwen3_8b_base", "qwen3_30b_a3b_base"])
def test_a_paper_config_starts_and_runs_every_phase_within_each_gpu(dry_run, name):
    run, wings = dry_run(name)  # a GPU the order overfills raises GpuMemoryError here, naming phase and holders
    n = len(run.plan.servers)
    assert wings.log == [x.format(n=n) for x in START]
    assert run.cfg.servers.engine_args.enable_memory_saver is True  # forced: release does nothing without it
    del wings.log[:]
    loop = run.loop
    loop.weights.before_training()
    loop.trainer.train_step([], np.zeros(0), 1.0, 1)
    loop.trainer.compute_logprobs([], 1.0)
    loop.rollout.version = 1
    loop.weights.push(1)
    # a restarted server while the others generate: its restore waits for the next push (the trainer's parameters
    # would not fit beside the others' KV pools and runtime shares), which the engine is told
    assert wings.restore(wings.addresses[0], 1) == {DEFERRED: 1.0}
    run.save()
    run.export()
    run.restore(run.out)
    assert wings.log == [
        "servers release weights,kv_cache,cuda_graph", "trainer reload", "train_step",
        "trainer offload grads,optimizer", "servers resume weights", f"send ipc v1 to {n} servers",
        "servers serve v1", "trainer offload params", "servers resume kv_cache,cuda_graph",
        # checkpoint and export while the servers have released their KV pool; the trainer's own calls bring
        # its state back (`_needs`) and offload it after
        "servers release kv_cache,cuda_graph", "save", "servers resume kv_cache,cuda_graph",
        "servers release kv_cache,cuda_graph", "export", "servers resume kv_cache,cuda_graph",
        "servers release kv_cache,cuda_graph", "load", "servers resume kv_cache,cuda_graph",
        # the restore's push: the servers hold their KV pool, so they release it for the parameters' return
        "trainer offload grads,optimizer", "servers release kv_cache,cuda_graph", f"send ipc v1 to {n} servers",
        "servers serve v1", "trainer offload params", "servers resume kv_cache,cuda_graph",
    ]
    ran = run.book.phase_peaks()
    planned = run.plan.book.phase_peaks()  # `rollverify plan`'s replay of the same order: the same peaks
    assert set(ran) == set(planned) and len(ran) == 2  # a server's first GPU and its others (each a rank's)
    for gpu_class, row in ran.items():
        assert set(row) == {"start", "rollout", "train", "verify", "sync", "checkpoint", "export", "restore"}
        assert {p: x.nbytes for p, x in row.items()} == {p: x.nbytes for p, x in planned[gpu_class].items()}
        assert max(x.nbytes for x in row.values()) <= 79.6 * GiB
        # the trainer's state never shares a GPU with a server's KV pool
        for phase, peak in row.items():
            holders = dict(peak.holders)
            beside = {h.rsplit(" ", 1)[1] for h in holders if h.startswith("trainer")} & {"params", "grads",
                                                                                         "optimizer"}
            if any("kv_cache" in h for h in holders):
                assert beside == set(), (phase, holders)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_restarted_trainer_starts_in_the_start_up_order_and_is_the_one_the_handoff_moves(dry_run, monkeypatch,
                                                                                          checkpointed):
    """A trainer fault mid-rollout (the servers hold their KV pool): the new ranks are built only once the
    servers have released their memory (beside it they would not fit: the book raises), offloaded, and the
    restore's push moves the new trainer's state, not the lost one's."""
    import copy

    import rollverify.app.ray_placement as placement

    run, wings = dry_run("qwen3_8b_base")
    n = len(run.plan.servers)
    if checkpointed:
        run.save()
    lost = run.trainer

    def start_trainer(model_path, cfg, cluster, **kw):
        wings.log.append("trainer built")
        return copy.copy(wings)  # a trainer of its own, logging to the same list

    monkeypatch.setattr(placement, "start_ray_trainer", start_trainer)
    del wings.log[:]
    assert run.restart_trainer() == 0
    assert run.trainer is not lost and run.handoff.trainer is run.trainer
    load = ["load"] if checkpointed else []
    assert wings.log == [x.format(n=n) for x in START[1:4]] + load + [x.format(n=n) for x in START[4:]]
    assert run.book.offloaded == {"params", "grads", "optimizer"} and not run.handoff.released


def test_a_ranks_cuda_report_is_held_against_its_entries_and_its_gpu():
    """`MemoryBook.compare`: torch's allocation against the rank's own entries, the device's use (mem_get_info)
    against everything the ledger has on that GPU."""
    from rollverify.app.gpu_memory import MemoryBook
    from rollverify.app.plan import make_plan

    book = MemoryBook(make_plan(load_config(CONFIGS / "qwen3_8b_base.yaml", check_task=False)))
    said: list[str] = []
    book.ledger.warn = said.append
    book.server_started(0)
    book.servers_released(("weights", "kv_cache", "cuda_graph"))
    with book.trainer_building():
        pass
    mine = sum(book.trainer_bytes[k] for k in ("params", "grads", "optimizer"))
    gpu = int(79.6 * GiB)
    book.enter("train")
    book.compare(0, {"allocated": mine, "free": gpu - book.ledger.total((0, 0)), "total": gpu})
    assert said == []
    book.compare(0, {"allocated": mine + 3 * GiB, "free": gpu - book.ledger.total((0, 0)) - 3 * GiB, "total": gpu})
    assert len(said) == 2 and "trainer rank 0 memory_allocated 28.7 GiB, the ledger counts 25.7 GiB" in said[0]
    assert "in use (mem_get_info)" in said[1]
    book.compare(1, {})  # off CUDA a rank reports nothing
    assert len(said) == 2
