"""Colocated weight push, payload by payload: SGLang's TP rank j of a server reads only payload j
(sglang/srt/managers/tp_worker.py `deserialize_own_rank`), so each must be its own serialization of the bucket as
built on TP rank j's GPU by the trainer rank there. Four gloo ranks stand for four GPUs (`LOCAL_RANK` is the GPU
a rank stands for; a CPU tensor's payload is a shared-memory handle), two servers of TP 2 on GPUs 0-1 and 2-3;
the same `IpcSender` / `IpcPeer` code runs on GPUs with CUDA IPC handles. Each rank's bucket holds its own rank
number, so a payload shows which rank built it."""

from __future__ import annotations

import pytest
import torch
from megatron_fixtures import SPAWN_TIMEOUT_S

pytestmark = pytest.mark.megatron

BUCKETS = 3


class _Recorder:
    """A BucketControl that opens every payload while its producer still holds it (as the server does)."""

    def __init__(self) -> None:
        self.seen: list[dict[int, list[tuple[float, int]]]] = []
        self.order: list[str] = []

    def begin(self, version):
        pass

    def announce(self, index, meta, payloads=None):
        import pickle

        got = {}
        for server, per_rank in payloads.items():
            opened = [pickle.loads(p)["flattened_tensor"].view(torch.float32) for p in per_rank]
            got[server] = [(float(t[0]), len({bytes(p) for p in per_rank})) for t in opened]
        self.seen.append(got)
        self.order.append(f"announce {index}")

    def settle(self, index):
        self.order.append(f"settle {index}")

    def commit(self, version, buckets):
        self.order.append(f"commit {buckets}")

    def abort(self, version, reason):
        self.order.append(f"abort {reason}")

    def close(self):
        pass

    def control_bytes(self):
        return 0


def _serialize(flat, meta) -> bytes:
    """SGLang's serializer without importing SGLang (seconds a process): torch's multiprocessing pickle of the
    flattened bucket, a shared-memory handle on CPU (sglang_ext.tensor_payload.serialize_flattened on a run)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": list(meta.names)})
    return buf.getvalue()


def _rank(rank: int, world_size: int):
    import torch.distributed as dist

    from megatron_bridge.weight_sync import IpcPeer, IpcSender, IpcServer, TransportSink, ipc_group
    from sglang_ext.cpu_compat import retry_shm_handshake

    retry_shm_handshake()  # the payloads are opened here as SGLang's children open them: with the same retry

    serialize_flattened = _serialize

    dist.init_process_group("gloo")
    layout = ((0, 1), (2, 3))  # server i's TP ranks sit on the GPUs of these trainer ranks
    groups = [ipc_group(r) for r in layout]
    server = rank // 2
    control = _Recorder()
    if rank == layout[server][0]:
        sender = IpcSender(control, [IpcServer(server, 2, groups[server])], serialize_flattened)
        prepare = sender.prepare

        def recorded(flat, meta, index):
            control.order.append(f"build {index}")
            return prepare(flat, meta, index)

        sender.prepare = recorded
        sink = TransportSink(control, sender)
    else:
        sender, sink = None, IpcPeer(groups[server], serialize_flattened)
    sink.begin(7)
    for b in range(BUCKETS):
        sink.push([("model.embed_tokens.weight", torch.full((64,), float(100 * b + rank)))])
    sink.end(7)
    return {"seen": control.seen, "order": control.order, "devices": sender.devices if sender else None}


def test_each_tp_rank_gets_its_own_payload_built_on_its_own_gpu():
    from megatron_bridge.parallel import spawn

    out = spawn(_rank, 4, timeout_s=SPAWN_TIMEOUT_S)
    for server, source in ((0, 0), (1, 2)):
        got = out[source]
        assert got["devices"] == {server: [f"cpu:{source}", f"cpu:{source + 1}"]}  # TP rank j: GPU of rank j
        assert len(got["seen"]) == BUCKETS
        for b, bucket in enumerate(got["seen"]):
            # payload j opens to the bucket rank `source + j` built, and the two are distinct serializations
            assert bucket == {server: [(100.0 * b + source, 2), (100.0 * b + source + 1, 2)]}
        # pipelined: bucket k + 1 is built (its payloads gathered) before bucket k is waited for
        assert got["order"] == ["build 0", "announce 0", "build 1", "settle 0", "announce 1", "build 2", "settle 1",
                                "announce 2", "settle 2", "commit 3"]
    assert out[1]["seen"] == out[3]["seen"] == []
