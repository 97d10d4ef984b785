"""A restarted colocated server while the others generate: its restore waits for the next push.

The trainer's parameters coming back on every rank would not fit beside the other servers' KV pools and SGLang's
runtime share (`rollverify plan`, phase rollout), so `TransportWeights.restore` defers, the engine gives that
server no response until a push reaches it, and the push clears it. Pure logic: a scripted server pool and
trainer (the real transport's restore runs in tests/test_weight_transport.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rollverify.app.handoff import Handoff
from rollverify.app.weight_transport import TransportWeights
from sglang_ext.pool import ServerAddress
from sglang_ext.rollout_engine import DEFERRED, ServedWeights, SGLangRolloutEngine


class Slot:
    def __init__(self, index: int) -> None:
        self.index, self.alive, self.paused, self.rids = index, True, False, set()
        self.conn = self

    async def submit(self, requests, sampling):
        return {"accepted": len(requests)}

    def address(self) -> ServerAddress:
        return ServerAddress(self.index, f"tcp://s{self.index}", None)


class Pool:
    def __init__(self, n: int) -> None:
        self.servers = [Slot(i) for i in range(n)]

    def alive(self):
        return [s for s in self.servers if s.alive]

    def fan(self, calls):
        return {s: asyncio.run(c) for s, c in calls.items()}

    def lost(self):
        return []


def _engine(n: int) -> SGLangRolloutEngine:
    engine = SGLangRolloutEngine.__new__(SGLangRolloutEngine)
    engine.pool, engine._lost, engine.faults = Pool(n), [], []
    engine.weights = ServedWeights(engine.pool, None)
    return engine


def _requests(groups: int):
    return [SimpleNamespace(rid=f"{g}-{i}", group=str(g)) for g in range(groups) for i in range(2)]


def test_a_deferred_server_gets_no_response_until_a_push_reaches_it():
    engine = _engine(3)
    engine.weights.restore = lambda address, version: {DEFERRED: 1.0}
    engine.weights.bring_up(engine.pool.servers[1])
    assert engine.awaiting_policy() == {1}
    engine._submit(_requests(4), None)
    assert {engine.where[q.rid].index for q in _requests(4)} == {0, 2}  # never the waiting server
    engine.committed(3)  # a push reached every live server
    assert engine.awaiting_policy() == set()
    engine._submit([SimpleNamespace(rid="x-0", group="x")], None)
    assert engine.where["x-0"].index == 1  # the least loaded again takes it
    engine.weights.bring_up(engine.pool.servers[0])
    engine.weights.bring_up(engine.pool.servers[2])
    engine.weights.bring_up(engine.pool.servers[1])
    with pytest.raises(RuntimeError, match=r"every live server \(\[0, 1, 2\]\) awaits the next weight push"):
        engine._submit([SimpleNamespace(rid="y-0", group="y")], None)


class Trainer:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def send_weights(self, spec, version, bucket_bytes):
        self.log.append(f"send to {list(spec.endpoints)} v{version}")
        return {"version": version}

    def offload(self, kinds):
        self.log.append(f"offload {','.join(kinds)}")
        return {}


class Servers:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def memory(self, action, tags):
        self.log.append(f"servers {action} {','.join(tags)}")


def _weights(live: list[int], waiting: set[int], *, colocated: bool = True):
    log: list[str] = []
    handoff = Handoff(colocated=colocated, offloads=colocated)
    handoff.servers, handoff.trainer = Servers(log), Trainer(log)
    engine = SimpleNamespace(awaiting_policy=lambda: set(waiting), live_servers=lambda: [
        ServerAddress(i, f"tcp://s{i}", None) for i in live])
    return TransportWeights(engine, handoff.trainer, "ipc", handoff=handoff), log


def test_the_colocated_restore_defers_while_another_server_serves():
    weights, log = _weights([0, 1], set())
    assert weights.restore(ServerAddress(1, "tcp://s1", None), 4) == {DEFERRED: 1.0} and log == []
    # the only server that serves: it holds no response, releases its KV pool and runtime share for the send
    weights, log = _weights([0, 1], {0})
    assert weights.restore(ServerAddress(1, "tcp://s1", None), 4) == {"version": 4}
    assert log == ["servers release kv_cache,cuda_graph", "send to ['tcp://s1'] v4",
                   "servers resume kv_cache,cuda_graph"]
    # disaggregated (its own GPUs): at once
    weights, log = _weights([0, 1], set(), colocated=False)
    assert weights.restore(ServerAddress(1, "tcp://s1", None), 4) == {"version": 4}
    assert log == ["send to ['tcp://s1'] v4"]


def test_buckets_are_collected_where_they_are_freed(monkeypatch):
    """`torch.cuda.ipc_collect` (`collect_ipc`) runs where a bucket's buffer is dropped: after the servers
    loaded it (the sink's pipeline settles it), after the commit, and on a peer rank when it drops the bucket
    before last and at the end."""
    import megatron_bridge.weight_sync as ws

    calls: list[str] = []
    monkeypatch.setattr(ws, "collect_ipc", lambda: calls.append("collect"))

    class Control:
        def begin(self, version): calls.append("begin")
        def settle(self, index): calls.append(f"settle {index}")
        def commit(self, version, buckets): calls.append("commit")
        def abort(self, version, reason): calls.append("abort")
        def close(self): calls.append("close")
        def control_bytes(self): return 0

    class Sender:
        def prepare(self, flat, meta, index): return b""
        def send(self, prepared, meta, index): calls.append(f"send {index}")
        def finish(self): calls.append("finish")

    sink = ws.TransportSink(Control(), Sender())
    sink.begin(1)
    for i in range(3):
        sink.push([("w", torch.full((4,), float(i)))])
    sink.end(1)
    assert calls == ["begin", "send 0", "settle 0", "collect", "send 1", "settle 1", "collect", "send 2", "settle 2",
                     "collect", "commit", "finish", "close", "collect"]
    calls.clear()
    monkeypatch.setattr(ws.dist, "gather_object", lambda *a, **k: None)
    monkeypatch.setattr(ws.dist, "get_global_rank", lambda group, rank: 0)
    monkeypatch.setattr(ws.dist, "barrier", lambda group=None: calls.append("barrier"))
    peer = ws.IpcPeer(object(), lambda flat, meta: b"")
    peer.begin(1)
    for i in range(3):
        peer.push([("w", torch.full((4,), float(i)))])
    peer.end(1)
    assert calls == ["collect", "barrier", "collect"]  # the third bucket drops the first; the end the rest
