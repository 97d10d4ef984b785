"""GPU weight transports run on CPU through the same code: a Megatron-Core trainer streams a new policy to a
real SGLang server (the session's CURVE-keyed one; several servers: tests/test_transport_ops.py) over SGLang's weight-update group (gloo instead of NCCL) and as flattened-bucket payloads
(shared memory instead of CUDA IPC); afterwards the server samples with log-probs equal to the trainer's.
Faults: a bucket a server would refuse is refused before any byte travels; a stream aborted after its first
bucket leaves the server on its old version and launching nothing until a whole version has arrived.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch
from engine_fixtures import reset_server, run
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = [*MARKS, pytest.mark.engine]
pytest_plugins = ["engine_fixtures"]  # the session servers, shared with the other sglang_ext tests

PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 2, 77, 13]]


@pytest.fixture
def servers(dense_server):
    """The session's tiny dense server (CURVE keys required), base weights before and after each test."""
    run(reset_server(dense_server))
    yield [dense_server]
    run(reset_server(dense_server))


@pytest.fixture(scope="module")
def trainer():
    """A trainer one Adam step away from the servers' checkpoint (a sync carries new weights)."""
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig

    path = tiny_path()
    t = MegatronTrainer(path, TrainerConfig(lr=2e-2, micro_batch_tokens=64))
    seqs = fixed_sequences(4, gens=(12, 20, 9, 16))
    lps, _ = hf_token_logprobs(path, seqs)
    for i, s in enumerate(seqs):
        s.rollout_logprobs, s.advantage = lps[i], (1.0, -1.0, 0.5, -0.5)[i]
    t.train_step(seqs)
    yield t
    t.close()


def _spec(servers, kind: str, **kw):
    from rollverify.app.weight_transport import TransportSpec

    return TransportSpec(kind, tuple(s.endpoint for s in servers), tuple(s.curve for s in servers),
                         master_addr="127.0.0.1", timeout_s=120.0, group=f"rv-test-{uuid.uuid4().hex[:8]}", **kw)


def _sample(server, version: int | None = None, max_new_tokens: int = 10):
    """Sample each prompt once on `server`; (prompt, tokens, log-probs, versions) per prompt."""
    from rollverify.interfaces import SamplingParams
    from rollverify.types import Group
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    with SGLangRolloutEngine([server.endpoint], curve=server.curve, timeout_s=120.0) as eng:
        groups = [Group.new(100 + i, p, 1, max_new_tokens) for i, p in enumerate(PROMPTS)]
        eng.submit([r for g in groups for r in g.responses], SamplingParams(temperature=1.0))
        got: dict[str, object] = {}
        deadline = time.monotonic() + 120
        while len(got) < len(groups) and time.monotonic() < deadline:
            for c in eng.wait_finished(2.0):
                got[c.response_id] = c
        eng.drop(list(got))
    out = []
    for g in groups:
        c = got[g.responses[0].response_id]
        out.append((np.asarray(g.prompt_ids), c.token_ids, c.logprobs, c.versions))
    return out


def _trainer_logprobs(trainer, samples) -> np.ndarray:
    from megatron_bridge.batch import TrainSequence

    seqs = [TrainSequence(p, t) for p, t, _, _ in samples]
    return trainer.compute_logprobs(seqs, temperature=1.0)[0]


def _health(server) -> dict:
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    with SGLangRolloutEngine([server.endpoint], curve=server.curve, timeout_s=60.0) as eng:
        return eng.health()[0]


@pytest.mark.parametrize("kind", ["distributed", "ipc"])
def test_transport_brings_every_server_to_the_trainers_policy(servers, trainer, kind):
    version = {"distributed": 11, "ipc": 12}[kind]
    stats = trainer.send_weights(_spec(servers, kind), version=version, bucket_bytes=64 << 10)
    assert stats["sync_buckets"] > 1 and stats["version"] == version
    for s in servers:
        samples = _sample(s)
        engine_lp = np.concatenate([lp for _, _, lp, _ in samples])
        assert all((v == version).all() for *_, v in samples)
        assert np.abs(engine_lp - _trainer_logprobs(trainer, samples)).max() < 1e-4


def test_a_bucket_a_server_would_refuse_is_refused_before_anything_travels(servers, trainer):
    from megatron_bridge.weight_sync import BucketMeta
    from sglang_ext.weight_transport import ServerControl

    spec = _spec(servers, "distributed")
    before = [_health(s)["version"] for s in servers]
    control = ServerControl(spec, [0])
    try:
        control.begin(before[0] + 1)
        bad = BucketMeta(("model.embed_tokens.weight",), ("float32",), ((3, 3),), 36)
        with pytest.raises(ValueError, match="serves no weight 'model.embed_tokens.weight'"):
            control.announce(0, bad)
    finally:
        control.close()
    assert [_health(s)["version"] for s in servers] == before


def test_a_stream_aborted_after_a_bucket_keeps_the_old_version_and_launches_nothing(servers, trainer):
    """The trainer fails after the first bucket was loaded: every server aborts the stream, still reports its
    old version, and refuses to launch until a whole version arrives (the next sync)."""
    from megatron_bridge import weight_sync
    from rollverify.app.weight_transport import TransportSpec

    spec = _spec(servers, "ipc")
    before = [_health(s)["version"] for s in servers]
    real = weight_sync.flatten_bucket
    calls = {"n": 0}

    def failing(bucket):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("trainer rank lost")
        return real(bucket)

    weight_sync.flatten_bucket = failing
    try:
        with pytest.raises(RuntimeError, match="trainer rank lost"):
            trainer.send_weights(spec, version=40, bucket_bytes=64 << 10)
    finally:
        weight_sync.flatten_bucket = real
    assert [_health(s)["version"] for s in servers] == before
    with pytest.raises(Exception, match="partly loaded"):
        _sample(servers[0])
    trainer.send_weights(TransportSpec("ipc", spec.endpoints, spec.curve, timeout_s=120.0), version=41,
                         bucket_bytes=64 << 10)
    samples = _sample(servers[0])
    assert all((v == 41).all() for *_, v in samples)
    assert np.abs(np.concatenate([lp for _, _, lp, _ in samples]) - _trainer_logprobs(trainer, samples)).max() < 1e-4


def test_flattened_bucket_is_sglangs_layout():
    """The bytes the source rank sends are exactly what SGLang's receive buffer splits back into tensors."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megatron_bridge.weight_sync import flatten_bucket

    bucket = [("a", torch.randn(3, 4)), ("b", torch.randn(6).to(torch.bfloat16)), ("c", torch.randn(2, 2))]
    flat, meta = flatten_bucket(bucket)
    ref = FlattenedTensorBucket(named_tensors=bucket)
    assert torch.equal(flat, ref.get_flattened_tensor()) and meta.nbytes == flat.numel()
    recv = FlattenedTensorBucket.empty(meta.names, meta.dtypes, meta.shapes, "cpu")
    recv.get_flattened_tensor().copy_(flat)
    assert all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(recv.reconstruct_tensors(), bucket,
                                                                      strict=True))
    with pytest.raises(ValueError, match="non-finite"):
        flatten_bucket([("x", torch.tensor([1.0, float("nan")]))])
    with pytest.raises(ValueError, match="byte offset 10"):  # SGLang's receive buffer needs aligned tensors
        flatten_bucket([("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.randn(2))])


def test_colocated_handoff_order_against_the_servers(servers, trainer):
    """Colocated: before training every server releases weights, KV cache and CUDA graphs and the trainer
    reloads; the push offloads the trainer's gradients and optimizer state, resumes the servers' weights, streams
    the buckets, offloads the parameters, then resumes KV cache and CUDA graphs. The servers' own bookkeeping
    refuses what would kill SGLang's scheduler (a resume of what was not released, a release twice). The
    trainer's side is the real one (megatron_bridge.offload): after the push its storages are released, the
    next training phase gets them back unchanged."""
    from megatron_bridge.loop_adapter import LoopTrainer
    from rollverify.app.config import load_config
    from rollverify.app.gpu_memory import MemoryBook
    from rollverify.app.handoff import Handoff
    from rollverify.app.plan import make_plan
    from rollverify.app.weight_transport import ServersMemory, TransportSpec, TransportWeights
    from rollverify.gpu_ledger import GiB
    from sglang_ext.rollout_engine import SGLangRolloutEngine
    from sglang_ext.weight_transport import ServerControl

    log: list[str] = []

    class Recorded(ServersMemory):
        def memory(self, action, tags):
            log.append(f"servers {action} {','.join(tags)}")
            super().memory(action, tags)

    class Sending(LoopTrainer):  # the loop's trainer, recorded
        def send_weights(self, spec, version, bucket_bytes=None):
            log.append(f"send {spec.kind} v{version}")
            return super().send_weights(spec, version, bucket_bytes)

        def offload(self, kinds=("params", "grads", "optimizer")):
            log.append(f"trainer offload {','.join(kinds)}")
            return super().offload(kinds)

        def reload(self):
            log.append("trainer reload")
            return super().reload()

    weights_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    loop_trainer = Sending(trainer, 64 << 10)
    # the ledger of a fake device: the paper's 8B plan (32 GPUs of 79.6 GiB, its byte figures) records what these
    # real calls would take and give back there, from the state start-up leaves (servers serving, trainer offloaded)
    book = MemoryBook(make_plan(load_config("qwen3_8b_base", check_task=False)))
    for s in book.plan.servers:
        book.server_started(s.index)
    book.servers_released(("weights", "kv_cache", "cuda_graph"))
    with book.trainer_building():
        pass
    book.trainer_offloaded(("params", "grads", "optimizer"))
    book.servers_resumed(("weights", "kv_cache", "cuda_graph"))
    with SGLangRolloutEngine([s.endpoint for s in servers], curve=servers[0].curve, timeout_s=120.0) as engine:
        handoff = Handoff(book, colocated=True, offloads=True)
        handoff.servers, handoff.trainer = Recorded(engine, 120.0), loop_trainer
        weights = TransportWeights(engine, loop_trainer, "ipc", handoff=handoff, timeout_s=120.0)
        engine.pause()
        weights.before_training()
        control = ServerControl(TransportSpec("ipc", tuple(s.endpoint for s in servers), (servers[0].curve,)), [0])
        try:
            with pytest.raises(RuntimeError, match="already released"):
                control.call_all("memory", {"action": "release", "tags": ["kv_cache"]}, "release again")
            pushed = weights.push(21)
            with pytest.raises(RuntimeError, match="were not released"):
                control.call_all("memory", {"action": "resume", "tags": ["weights"]}, "resume again")
        finally:
            control.close()
        engine.resume()
    assert log == [
        "servers release weights,kv_cache,cuda_graph", "trainer reload",
        "trainer offload grads,optimizer", "servers resume weights", "send ipc v21",
        "trainer offload params", "servers resume kv_cache,cuda_graph",
    ]
    assert trainer.memory.offloaded == ("params", "grads", "optimizer")
    assert book.offloaded == {"params", "grads", "optimizer"} and not handoff.released
    gpu = (0, 0)  # trainer rank 0 and server 0's first GPU
    assert set(book.ledger.holders(gpu)) == {"server 0 context", "server 0 weights", "server 0 kv_cache",
                                             "server 0 runtime", "trainer rank 0 context"}
    train, sync = book.ledger.peaks["train"][gpu], book.ledger.peaks["sync"][gpu]
    assert not any("kv_cache" in h for h, _ in train.holders + sync.holders)  # never beside the trainer's state
    assert {h for h, _ in sync.holders} >= {"server 0 weights", "trainer rank 0 params", "trainer rank 0 bucket"}
    assert train.nbytes > 20 * GiB and sync.nbytes < 20 * GiB
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert pushed["version"] == 21 and pushed["offload/params_bytes"] >= param_bytes  # the push reports the release
    for s in servers:
        samples = _sample(s)
        assert all((v == 21).all() for *_, v in samples)
        assert np.abs(np.concatenate([lp for _, _, lp, _ in samples]) - _trainer_logprobs(trainer, samples)).max() < 1e-4
    loop_trainer.reload()  # the next training phase
    assert all(torch.equal(p, weights_before[n]) for n, p in trainer.model.named_parameters())


def test_a_restarted_server_gets_the_policy_through_the_transport(servers, trainer):
    """`TransportWeights.restore`, the engine's `restore_weights` for a restarted server: the trainer's ranks send
    it the current version over a weight-update group of its own; nothing goes through the driver."""
    from rollverify.app.handoff import Handoff
    from rollverify.app.weight_transport import TransportWeights
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    with SGLangRolloutEngine([s.endpoint for s in servers], curve=servers[0].curve, timeout_s=120.0) as engine:
        weights = TransportWeights(engine, trainer, "distributed", handoff=Handoff(colocated=False, offloads=False),
                                   master_addr="127.0.0.1", bucket_bytes=64 << 10, timeout_s=120.0)
        stats = weights.restore(engine.live_servers()[0], 33)
    assert stats["version"] == 33 and stats["sync_buckets"] > 1
    samples = _sample(servers[0])
    assert all((v == 33).all() for *_, v in samples)
    assert np.abs(np.concatenate([lp for _, _, lp, _ in samples]) - _trainer_logprobs(trainer, samples)).max() < 1e-4
