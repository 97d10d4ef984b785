"""The streamed weight transports' bookkeeping, on fake engines behind real control servers (no SGLang, ~1 s):
a version is committed on every server only after every server loaded every bucket; a failure on one server
aborts the stream on all, which keep their old version and refuse to launch until a whole version arrives; the
memory handoff refuses what would kill SGLang's scheduler. The real engines: tests/test_weight_transport.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from engine_fixtures import FakeEngine, FakeServer

from megatron_bridge.weight_sync import TransportSink


class StreamEngine(FakeEngine):
    """FakeEngine with the coroutines of EngineHandle.transport (and flush), recording each call; `fail_at` makes
    the load of that bucket (counted from 0 over the server's life) raise."""

    def __init__(self, fail_at: int | None = None):
        super().__init__(moe=False)
        self.calls: list[str] = []
        self.loaded = 0
        self.fail_at = fail_at
        self.tp_size = 1
        self.transport = self  # EngineHandle.transport: here the recorded coroutines below

    async def begin_weight_update(self):
        self.calls.append("begin")

    async def end_weight_update(self):
        self.calls.append("end")

    async def load_flattened(self, payloads):
        await asyncio.sleep(0)
        if self.loaded == self.fail_at:
            self.loaded += 1
            raise RuntimeError("scheduler refused the tensor")
        self.loaded += 1
        self.calls.append(f"load {payloads[0]}")

    async def flush(self):
        self.calls.append("flush")

    async def release_memory(self, tags):
        self.calls.append(f"release {','.join(tags)}")

    async def resume_memory(self, tags):
        self.calls.append(f"resume {','.join(tags)}")


BUCKETS = [[("model.embed_tokens.weight", torch.full((128, 8), float(i)))] for i in range(3)]


def _sink(servers):
    from rollverify.app.weight_transport import TransportSpec
    from sglang_ext.weight_transport import ServerControl

    spec = TransportSpec("ipc", tuple(s.endpoint for s in servers), timeout_s=20.0)
    control = ServerControl(spec, list(range(len(servers))))
    return TransportSink(control, _Labels(control, len(servers)))


class _Labels:
    """A sender whose payloads are labels: bucket i carries b"b{i}" to every server."""

    def __init__(self, control, n: int):
        self.control, self.n = control, n

    def prepare(self, flat, meta, index):
        return {s: [f"b{index}".encode()] for s in range(self.n)}

    def send(self, prepared, meta, index):
        self.control.announce(index, meta, prepared)

    def finish(self):
        pass


def _stream(servers, version: int) -> None:
    sink = _sink(servers)
    sink.begin(version)
    for b in BUCKETS:
        sink.push(b)
    sink.end(version)


def _version(server) -> int:
    return server.server.records.version


def test_a_version_commits_on_every_server_after_every_bucket():
    with FakeServer(StreamEngine()) as a, FakeServer(StreamEngine()) as b:
        _stream([a, b], 3)
        for s in (a, b):
            assert _version(s) == 3 and s.server.records.blocked is None
            assert s.engine.calls == ["begin", "load YjA=", "load YjE=", "load YjI=", "end", "flush"]


def test_a_failure_on_one_server_aborts_all_and_blocks_launching_until_a_whole_version():
    from sglang_ext.client import ControlError, SubmitRequest

    with FakeServer(StreamEngine()) as a, FakeServer(StreamEngine(fail_at=1)) as b:
        sink = _sink([a, b])
        sink.begin(5)
        sink.push(BUCKETS[0])
        sink.push(BUCKETS[1])  # pipelined: bucket 1's failure shows when bucket 2 waits for it
        with pytest.raises(RuntimeError, match=rf"bucket 1 of version 5 failed on 1 of 2 server\(s\): {b.endpoint}"):
            sink.push(BUCKETS[2])
        for s in (a, b):
            assert _version(s) == 0 and "partly loaded" in s.server.records.blocked
            assert s.engine.calls[-1] == "end" and "flush" not in s.engine.calls
        assert a.engine.calls == ["begin", "load YjA=", "load YjE=", "end"]  # loaded bucket 1, then the abort

        async def submit():
            from sglang_ext.client import ServerConnection

            conn = await ServerConnection(a.endpoint, timeout_s=10.0).start()
            try:
                await conn.submit([SubmitRequest("r0", np.array([5, 6, 7]), 4)])
            finally:
                await conn.close()

        with pytest.raises(ControlError, match="WEIGHTS_INCOMPLETE|partly loaded"):
            asyncio.run(submit())
        assert not a.server.records.table  # nothing was accepted
        _stream([a, b], 6)
        assert _version(a) == _version(b) == 6 and a.server.records.blocked is b.server.records.blocked is None
        asyncio.run(submit())


def test_commit_of_another_bucket_count_is_refused_and_ends_the_stream():
    from sglang_ext.client import ControlError, ServerConnection

    with FakeServer(StreamEngine()) as a:
        sink = _sink([a])
        sink.begin(2)
        sink.push(BUCKETS[0])
        sink.control.settle(0)  # bucket 0 has loaded (the pipelined sink waits for it only before bucket 1)

        async def commit():
            conn = await ServerConnection(a.endpoint, timeout_s=10.0).start()
            try:
                await conn.call("update_weights_ipc", {"step": "commit", "version": 2, "buckets": 3})
            finally:
                await conn.close()

        with pytest.raises(ControlError, match="commit of 3 ipc bucket"):
            asyncio.run(commit())
        sink.control.close()
        assert _version(a) == 0 and a.server.records.blocked


def test_memory_handoff_bookkeeping():
    from rollverify.app.weight_transport import TransportSpec
    from sglang_ext.weight_transport import ServerControl

    with FakeServer(StreamEngine()) as a:
        control = ServerControl(TransportSpec("ipc", (a.endpoint,), timeout_s=20.0), [0])
        try:
            with pytest.raises(RuntimeError, match="were not released"):
                control.call_all("memory", {"action": "resume", "tags": ["weights"]}, "resume")
            control.call_all("memory", {"action": "release", "tags": []}, "release")
            with pytest.raises(RuntimeError, match="already released"):
                control.call_all("memory", {"action": "release", "tags": ["kv_cache"]}, "release")
            control.call_all("memory", {"action": "resume", "tags": ["weights"]}, "resume")
            control.call_all("memory", {"action": "resume", "tags": ["kv_cache", "cuda_graph"]}, "resume")
        finally:
            control.close()
        assert a.engine.calls == ["release weights,kv_cache,cuda_graph", "resume weights",
                                  "resume kv_cache,cuda_graph"]


@pytest.mark.megatron  # the 30B-A3B layout on meta tensors
def test_a_paper_push_takes_one_data_collective_one_host_sync_and_one_round_trip_per_bucket():
    """tools/push_ops.py counts the real push (Qwen3-30B-A3B's layout: TP 4, EP 16, servers of TP 4) on meta
    tensors: per bucket one all-gather of shards (none for buckets of replicated tensors), one gather of the
    TP ranks' IPC payloads, one finite check read back and one message to the server; with buckets that hold a
    layer's experts, each layer's 128 experts come in one all-gather over the EP group."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import push_ops

    r = push_ops.push_counts("configs/qwen3_30b_a3b_base.yaml", 1280 << 20)
    n, detail = r["buckets"], r["detail"]
    assert r["tensors"] == 48 * (128 * 3 + 9) + 3 and r["payloads"] == n * 1  # this rank's own, one a bucket
    data = {k: v for k, v in detail.items() if k.startswith("collectives:all_gather")}
    assert sum(data.values()) <= n and detail["collectives:all_gather@etp_ep"] == 48  # one a layer
    assert detail["collectives:gather_object@ipc"] == n and detail["collectives:barrier@ipc"] == 1
    assert r["host_syncs"] == n and detail["round_trips:bucket"] == n and r["round_trips_per_server"] == n + 2
