"""Weight transports from the trainer's ranks straight to the SGLang servers; ZMQ carries control only.

    placement       transport      data path of each bucket
    local launcher  in_memory      trainer -> driver -> ZMQ frames -> server (`SGLangRolloutEngine.update_weights`)
    disaggregated   distributed    trainer source rank --broadcast (NCCL; gloo on CPU)--> every server's TP ranks
    colocated       ipc            trainer rank --CUDA IPC handle (shared memory on CPU)--> the server on its GPUs

`TransportSpec` is what the driver hands the trainer (it crosses a pipe or Ray): the servers' endpoints and
keys, and how to reach them. On each trainer rank `spec.open_sink(rank)` is the rank's `WeightSink` for
`megatron_bridge.weight_sync.sync` (None where the rank only joins the gathers): a `TransportSink` whose control
is a `ServerControl` (this rank's own ZMQ connections to the servers: the server ops of
`sglang_ext/ops/transport.py`) and whose sender moves the bytes. The trainer streams its export bucket by bucket
(each bucket gathered over TP/EP when it is built), so no process holds a whole copy of the model.

A version is committed on the servers only after every server has loaded every bucket; any failure aborts the
stream on every server, which then keeps reporting its old version (see the ops module for a half-loaded
engine) and the error names the server.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from sglang_ext.client import ControlError, CurveKeys, ServerConnection

log = logging.getLogger(__name__)

TransportKind = Literal["in_memory", "distributed", "ipc"]

# weight-update groups this process joined as rank 0, by name: they outlive one sync (joining costs a rendezvous)
_GROUPS: dict[str, Any] = {}


def transport_for(launcher: str, placement: str) -> TransportKind:
    """The transport a cluster layout uses: the local launcher keeps the in-memory buckets; on a cluster a
    colocated server shares GPUs with trainer ranks (IPC), a disaggregated one has its own (broadcast)."""
    if launcher == "local":
        return "in_memory"
    return "ipc" if placement == "colocated" else "distributed"


@dataclass(frozen=True)
class TransportSpec:
    """How a trainer rank reaches the servers for one transport (picklable).

    `group` names the weight-update group (distributed): a new name makes a new group, as when a server was
    replaced. `master_addr` is the source rank's address the servers connect to (default: its host's address);
    `backend` defaults to NCCL with a GPU, gloo without. `ipc_sources[i]` is the trainer rank colocated with
    server i (its first GPU), which sends it every bucket (default: rank 0 for every server). With several
    source ranks each commits its own servers once they have loaded every bucket; the ranks do not agree on the
    commit among themselves, so a failure on one leaves the others' servers on the new version (each server
    still whole)."""

    kind: Literal["distributed", "ipc"]
    endpoints: tuple[str, ...]
    curve: tuple[CurveKeys | None, ...] = ()
    server_tp: tuple[int, ...] = ()
    group: str = "rollverify-weights"
    backend: str | None = None
    master_addr: str | None = None
    ipc_sources: tuple[int, ...] = ()
    timeout_s: float = 300.0
    source_rank: int = 0

    def __post_init__(self) -> None:
        n = len(self.endpoints)
        if not n:
            raise ValueError("a weight transport needs at least one server endpoint")
        for name in ("curve", "server_tp", "ipc_sources"):
            got = getattr(self, name)
            if got and len(got) != n:
                raise ValueError(f"TransportSpec.{name} has {len(got)} entries for {n} endpoints (one each)")

    def open_sink(self, rank: int):
        """This rank's `WeightSink` (None: it only takes part in the gathers)."""
        from megatron_bridge.weight_sync import TransportSink, broadcast_sender, ipc_sender

        mine = [i for i in range(len(self.endpoints)) if self._sender_of(i) == rank]
        if not mine:
            return None
        control = ServerControl(self, mine)
        if self.kind == "distributed":
            return TransportSink(control, broadcast_sender(control, control.join_group()))
        return TransportSink(control, ipc_sender(control, self._tp(mine[0])))

    def _sender_of(self, server: int) -> int:
        if self.kind == "ipc" and self.ipc_sources:
            return self.ipc_sources[server]
        return self.source_rank

    def _tp(self, server: int) -> int:
        return self.server_tp[server] if self.server_tp else 1


@dataclass
class _Pending:
    index: int
    calls: dict[int, Any] = field(default_factory=dict)  # server index -> concurrent future of its reply


class ServerControl:
    """The `BucketControl` of one trainer rank: its own ZMQ connections to its servers, on an event loop of its
    own (the trainer's thread blocks in the broadcast while the servers' replies are outstanding)."""

    def __init__(self, spec: TransportSpec, servers: list[int]) -> None:
        self.spec, self.servers = spec, servers
        self.kind = spec.kind
        self.op = "update_weights_distributed" if spec.kind == "distributed" else "update_weights_ipc"
        self.version = -1
        self.pending: _Pending | None = None
        self.served: dict[int, dict[str, tuple[list[int], str]]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-transport", daemon=True)
        self._thread.start()
        self.conns: dict[int, ServerConnection] = {}
        try:
            for i in servers:
                curve = spec.curve[i] if spec.curve else None
                conn = ServerConnection(spec.endpoints[i], curve=curve, timeout_s=spec.timeout_s)
                self.conns[i] = self._run(conn.start())
        except BaseException:
            self.close()
            raise

    # --- BucketControl ----------------------------------------------------------------------------------

    def begin(self, version: int) -> None:
        """Read each server's checkpoint (names, shapes, dtypes) once, to check buckets before they travel."""
        self.version = version
        for i, conn in self.conns.items():
            if i not in self.served:
                ws = self._run(conn.call("weights")).body["weights"]
                self.served[i] = {w["name"]: (list(w["shape"]), w["dtype"]) for w in ws}

    def announce(self, index: int, meta, payloads: list[bytes] | None = None) -> None:
        """Send bucket `index`'s step to every server without waiting; refuse a bucket a server would refuse
        before anything is sent (a broadcast nobody receives would only end at the timeout)."""
        self._check(meta)
        body: dict[str, Any] = {"step": "bucket", "version": self.version, "bucket": index, **meta.as_body()}
        if self.kind == "distributed":
            body["group"] = self.spec.group
        else:
            body["payloads"] = [base64.b64encode(p).decode() for p in payloads or []]
        self.pending = _Pending(index, {i: self._submit(c.call(self.op, body)) for i, c in self.conns.items()})

    def settle(self, index: int) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None and pending.index == index, f"settle({index}) without its announce"
        self._gather(pending.calls, f"bucket {index} of version {self.version}")

    def commit(self, version: int, buckets: int) -> None:
        self.call_all(self.op, {"step": "commit", "version": version, "buckets": buckets},
                      f"commit of version {version}")

    def abort(self, version: int, reason: str) -> None:
        """Best effort: every server ends the stream; an unreachable one is logged (its own timeout ends it)."""
        if self.pending is not None:  # let the outstanding bucket finish or fail first
            for fut in self.pending.calls.values():
                try:
                    fut.result(self.spec.timeout_s)
                except Exception:  # noqa: BLE001 - the reason is already being reported
                    pass
            self.pending = None
        body = {"step": "abort", "version": version, "reason": reason[:4000]}
        for i, conn in self.conns.items():
            try:
                self._run(conn.call(self.op, body, timeout_s=30.0))
            except Exception as e:  # noqa: BLE001
                log.warning("server %s: abort of version %d not delivered: %s", self.spec.endpoints[i], version, e)

    # --- the weight-update group (distributed) -----------------------------------------------------------

    def join_group(self):
        """The weight-update group of `spec.group`, joined now unless this process already has: every server
        is asked to join (rank offsets after this rank 0, by TP size), then this rank joins as rank 0."""
        from megatron_bridge.weight_sync import join_weight_group

        if self.spec.group in _GROUPS:
            return _GROUPS[self.spec.group]
        import torch

        backend = self.spec.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        addr = self.spec.master_addr or _host_address()
        port = _free_port(addr)
        offsets, world = {}, 1
        for i in range(len(self.spec.endpoints)):
            offsets[i], world = world, world + self.spec._tp(i)
        if set(self.conns) != set(offsets):
            raise ValueError("the distributed transport's source rank must reach every server")
        calls = {
            i: self._submit(c.call("weights_group", {
                "master_addr": addr, "master_port": port, "rank_offset": offsets[i], "world_size": world,
                "group": self.spec.group, "backend": backend,
            }, timeout_s=self.spec.timeout_s))
            for i, c in self.conns.items()
        }
        try:
            group = join_weight_group(addr, port, world, self.spec.group, backend, self.spec.timeout_s)
        except Exception as e:
            failed = self._failures(calls, 1.0)
            raise RuntimeError(
                f"weight-update group {self.spec.group!r} ({backend}, {addr}:{port}, world size {world}) did not "
                f"form within {self.spec.timeout_s:.0f} s: {e}" + (f"; servers: {failed}" if failed else "")
            ) from e
        self._gather(calls, f"joining weight-update group {self.spec.group!r}")
        _GROUPS[self.spec.group] = group
        return group

    def call_all(self, op: str, body: dict[str, Any], what: str) -> None:
        """`op` on every server at once; raises naming each server that failed."""
        self._gather({i: self._submit(c.call(op, body)) for i, c in self.conns.items()}, what)

    # --- plumbing ----------------------------------------------------------------------------------------

    def _check(self, meta) -> None:
        for i, served in self.served.items():
            bad = [n for n, d, s in zip(meta.names, meta.dtypes, meta.shapes, strict=True)
                   if n not in served or served[n][0] != list(s) or d not in ("float32", "bfloat16", "float16")]
            if bad:
                n = bad[0]
                have = served.get(n)
                raise ValueError(
                    f"server {self.spec.endpoints[i]} serves no weight {n!r} of this shape and dtype (it has "
                    f"{'no such name' if have is None else have}); {len(bad)} such tensor(s). Nothing was sent"
                )

    def _submit(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine) -> Any:
        return self._submit(coro).result(self.spec.timeout_s + 30.0)

    def _failures(self, calls: dict[int, Any], timeout: float | None) -> dict[str, str]:
        failed = {}
        for i, fut in calls.items():
            try:
                fut.result(timeout)
            except ControlError as e:
                failed[self.spec.endpoints[i]] = f"{e.code}: {e.message}"
            except Exception as e:  # noqa: BLE001 - a timeout or a closed connection
                failed[self.spec.endpoints[i]] = f"{type(e).__name__}: {e}"
        return failed

    def _gather(self, calls: dict[int, Any], what: str) -> None:
        failed = self._failures(calls, self.spec.timeout_s + 30.0)
        if failed:
            raise RuntimeError(f"{what} failed on {len(failed)} of {len(calls)} server(s): "
                               + "; ".join(f"{ep}: {msg}" for ep, msg in failed.items()))

    def control_bytes(self) -> int:
        return sum(sum(c.bytes_out.values()) for c in self.conns.values())

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                self._run(conn.close())
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)


def _host_address() -> str:
    """This host's address as other hosts reach it (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- the loop's side


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class TransportWeights:
    """The loop's `WeightSync` for a cluster: the trainer's ranks stream each version straight to the servers
    (`kind` distributed or ipc), and with `colocated` the servers and the trainer hand GPU memory to each other.

    Colocated order (after slime's, on SGLang 0.5.23's release/resume):

        before_training: servers release weights, KV cache, CUDA graphs -> trainer reloads its state
        push(version):   trainer offloads gradients and optimizer state -> servers resume weights ->
                         buckets (IPC) -> trainer offloads its parameters -> servers resume KV cache, CUDA graphs

    so the two never hold their big allocations at once: released weights come back undefined, and the push
    that follows their resume fills them. `trainer_memory` offloads and reloads the trainer's state on every rank
    (`offload(kinds)`, `reload()`: `megatron_bridge.loop_adapter.LoopTrainer` over `megatron_bridge.offload`);
    without one (`trainer.offload_between_phases: false`) the trainer keeps its memory."""

    def __init__(self, engine: Any, trainer: Any, kind: Literal["distributed", "ipc"], *, colocated: bool,
                 server_tp: int = 1, master_addr: str | None = None, backend: str | None = None,
                 bucket_bytes: int = 64 << 20, timeout_s: float = 300.0, trainer_memory: Any = None,
                 trainer_ranks: int = 1) -> None:
        self.engine, self.trainer, self.kind, self.colocated = engine, trainer, kind, colocated
        self.trainer_ranks = trainer_ranks
        self.server_tp, self.master_addr, self.backend = server_tp, master_addr, backend
        self.bucket_bytes, self.timeout_s, self.trainer_memory = bucket_bytes, timeout_s, trainer_memory
        self._group: tuple[tuple[str, ...], str] | None = None  # endpoints of the current group and its name
        self.released = False

    def spec(self) -> TransportSpec:
        """The live servers' spec; a new weight-update group whenever the set of servers changed."""
        live = self.engine.pool.alive()
        endpoints = tuple(s.conn.endpoint for s in live)
        if self._group is None or self._group[0] != endpoints:
            self._group = (endpoints, _group_name())
        return self._spec_of(live, self._group[1])

    def _spec_of(self, slots: list[Any], group: str) -> TransportSpec:
        # colocated, GPU by GPU: trainer rank r on the layout's GPU r, server i from GPU i * tp (slime's layout:
        # rollout from offset 0); server i's buckets come from the rank on its first GPU
        sources = tuple(s.index * self.server_tp if s.index * self.server_tp < self.trainer_ranks else 0
                        for s in slots)
        return TransportSpec(self.kind, tuple(s.conn.endpoint for s in slots), tuple(s.conn.curve for s in slots),
                             (self.server_tp,) * len(slots), group=group, backend=self.backend,
                             master_addr=self.master_addr, ipc_sources=sources if self.kind == "ipc" else (),
                             timeout_s=self.timeout_s)

    def restore(self, server: Any, version: int) -> dict[str, float]:
        """A restarted server (the engine's `restore_weights`: a pool slot serving the original checkpoint) gets
        `version` through this transport from the trainer's ranks, like a push: over a weight-update group of
        its own (distributed; the next push forms a new group with every live server), or from the rank on its
        first GPU (ipc). While the trainer is offloaded its parameters come back for the send only."""
        return self.trainer.send_weights(self._spec_of([server], _group_name()), version, self.bucket_bytes)

    def before_training(self) -> None:
        if not self.colocated:
            return
        self._memory("release", list(MEMORY_TAGS))
        self.released = True
        if self.trainer_memory is not None:
            self.trainer_memory.reload()

    def push(self, version: int) -> dict[str, float]:
        offloading = self.colocated and self.trainer_memory is not None
        released = self.trainer_memory.offload(("grads", "optimizer")) if offloading else {}
        if self.released:
            self._memory("resume", ["weights"])
        stats = self.trainer.send_weights(self.spec(), version, self.bucket_bytes)
        self.engine.version = version
        if offloading:
            released = {**released, **self.trainer_memory.offload(("params",))}
        if self.released:
            self._memory("resume", ["kv_cache", "cuda_graph"])
            self.released = False
        return {**stats, **released}

    def _memory(self, action: str, tags: list[str]) -> None:
        spec = self.spec()
        control = ServerControl(spec, list(range(len(spec.endpoints))))
        try:
            control.call_all("memory", {"action": action, "tags": tags}, f"memory {action} {tags}")
        finally:
            control.close()


def _group_name() -> str:
    import uuid

    return f"rollverify-weights-{uuid.uuid4().hex[:12]}"


def weight_sync_for(launcher: str, placement: str, engine: Any, trainer: Any, *, server_tp: int = 1,
                    **kwargs: Any) -> TransportWeights | None:
    """The loop's `WeightSync` for a cluster layout; None for the local launcher (the loop's in-memory path)."""
    kind = transport_for(launcher, placement)
    if kind == "in_memory":
        return None
    return TransportWeights(engine, trainer, kind, colocated=placement == "colocated", server_tp=server_tp, **kwargs)
