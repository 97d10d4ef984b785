"""The weight transport between the wings: the trainer's ranks stream each version straight to the SGLang
servers; ZMQ carries control only.

    placement       transport      data path of each bucket
    local launcher  in_memory      trainer -> driver -> ZMQ frames -> server (`SGLangRolloutEngine.update_weights`)
    disaggregated   distributed    trainer source rank --broadcast (NCCL; gloo on CPU)--> every server's TP ranks
    colocated       ipc            the trainer rank on each of a server's GPUs --CUDA IPC handle (shared memory on
                                   CPU), gathered to the first--> that GPU's server TP rank

`TransportSpec` is what the driver hands the trainer (it crosses a pipe or Ray): the servers' endpoints and
keys, and how to reach them. On each trainer rank `spec.open_sink(rank)` is the rank's `WeightSink` for
`megatron_bridge.weight_sync.sync_buckets` (None where the rank only joins the gathers): the trainer wing's
`TransportSink` whose control is the server wing's `ServerControl` (this rank's own ZMQ connections to the
servers) and whose sender moves the bytes, or (ipc) an `IpcPeer` that hands its own GPU's payloads to the
server's source rank. The trainer streams its export bucket by bucket (each bucket gathered over TP/EP, one
collective, when it is built), so no process holds a whole copy of the model. `TransportWeights` is the loop's
`WeightSync` over it; each wing keeps its own end, and this module joins them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatron_bridge.weight_sync import (
    BroadcastSender,
    IpcPeer,
    IpcSender,
    IpcServer,
    TransportSink,
    ipc_group,
    join_weight_group,
)
from sglang_ext.client import CurveKeys
from sglang_ext.pool import ServerAddress
from sglang_ext.rollout_engine import DEFERRED
from sglang_ext.tensor_payload import serialize_flattened
from sglang_ext.weight_transport import ServerControl

if TYPE_CHECKING:
    from rollverify.app.handoff import Handoff

TransportKind = Literal["in_memory", "distributed", "ipc"]


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
    `backend` defaults to NCCL with a GPU, gloo without. `ipc_ranks[i]` are the trainer ranks on server i's
    GPUs in its TP order (ipc): each builds every bucket on its own GPU and hands its payload to the first,
    server i's source, which sends the server one payload per TP rank; without them rank `source_rank` serves
    every server (CPU layouts). With several source ranks each commits its own servers once they have loaded
    every bucket; the ranks do not agree on the commit among themselves, so a failure on one leaves the others'
    servers on the new version (each server still whole)."""

    kind: Literal["distributed", "ipc"]
    endpoints: tuple[str, ...]
    curve: tuple[CurveKeys | None, ...] = ()
    server_tp: tuple[int, ...] = ()
    group: str = "rollverify-weights"
    backend: str | None = None
    master_addr: str | None = None
    ipc_ranks: tuple[tuple[int, ...], ...] = ()
    timeout_s: float = 300.0
    source_rank: int = 0

    def __post_init__(self) -> None:
        n = len(self.endpoints)
        if not n:
            raise ValueError("a weight transport needs at least one server endpoint")
        for name in ("curve", "server_tp", "ipc_ranks"):
            got = getattr(self, name)
            if got and len(got) != n:
                raise ValueError(f"TransportSpec.{name} has {len(got)} entries for {n} endpoints (one each)")
        for i, ranks in enumerate(self.ipc_ranks):
            if len(ranks) != self.tp(i):
                raise ValueError(f"TransportSpec.ipc_ranks[{i}] names {len(ranks)} trainer ranks for a server of "
                                 f"TP {self.tp(i)} (one per TP rank)")

    def open_sink(self, rank: int):
        """This rank's `WeightSink` (None: it only takes part in the gathers): the server wing's control end
        and the trainer wing's sender, joined here. Collective for ipc with TP > 1 servers: every rank makes
        each server's payload group (gloo) in the same order."""
        groups = {i: ipc_group(ranks) for i, ranks in enumerate(self.ipc_ranks) if len(ranks) > 1}
        peer_of = [i for i, ranks in enumerate(self.ipc_ranks) if rank in ranks[1:]]
        if peer_of:
            return IpcPeer(groups[peer_of[0]], serialize_flattened)
        mine = [i for i in range(len(self.endpoints)) if self._sender_of(i) == rank]
        if not mine:
            return None
        control = ServerControl(self, mine)
        if self.kind == "distributed":
            return TransportSink(control, BroadcastSender(control, control.join_group(join_weight_group)))
        servers = [IpcServer(i, self.tp(i), groups.get(i)) for i in mine]
        return TransportSink(control, IpcSender(control, servers, serialize_flattened))

    def _sender_of(self, server: int) -> int:
        if self.kind == "ipc" and self.ipc_ranks:
            return self.ipc_ranks[server][0]
        return self.source_rank

    def tp(self, server: int) -> int:
        return self.server_tp[server] if self.server_tp else 1


class ServersMemory:
    """The handoff's server side: every live server of `engine` releases or resumes SGLang's memory of `tags`
    (the `memory` call of docs/protocol.md), over control connections of its own."""

    def __init__(self, engine: Any, timeout_s: float = 300.0) -> None:
        self.engine, self.timeout_s = engine, timeout_s

    def memory(self, action: str, tags: list[str]) -> None:
        live = self.engine.live_servers()
        spec = TransportSpec("ipc", tuple(s.endpoint for s in live), tuple(s.curve for s in live),
                             timeout_s=self.timeout_s)
        control = ServerControl(spec, list(range(len(spec.endpoints))))
        try:
            control.call_all("memory", {"action": action, "tags": tags}, f"memory {action} {tags}")
        finally:
            control.close()


class TransportWeights:
    """The loop's `WeightSync` for a cluster: the trainer's ranks stream each version straight to the servers
    (`kind` distributed or ipc); colocated, the servers and the trainer hand GPU memory to each other in
    `handoff`'s order (rollverify.app.handoff: before training the servers release weights, KV cache and CUDA
    graphs and the trainer reloads; a push offloads the trainer's gradients and optimizer state, resumes the
    servers' weights, sends the buckets, offloads the trainer's parameters and resumes the servers' KV cache
    and CUDA graphs), so the two never hold their big allocations at once.

    The handoff's trainer side is the trainer's `offload(kinds)` / `reload()` (`megatron_bridge.loop_adapter.
    LoopTrainer` over `megatron_bridge.offload`); its server side defaults to `ServersMemory` over `engine`.
    `live` lists the servers to send to (default: the engine's live ones)."""

    def __init__(self, engine: Any, trainer: Any, kind: Literal["distributed", "ipc"], *, handoff: Handoff,
                 server_tp: int = 1, master_addr: str | None = None, backend: str | None = None,
                 bucket_bytes: int = 64 << 20, timeout_s: float = 300.0, trainer_ranks: int = 1,
                 live: Callable[[], list[ServerAddress]] | None = None) -> None:
        self.engine, self.trainer, self.kind = engine, trainer, kind
        self.trainer_ranks = trainer_ranks
        self.server_tp, self.master_addr, self.backend = server_tp, master_addr, backend
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        if handoff.servers is None:
            handoff.servers = ServersMemory(engine, timeout_s)
        self.handoff = handoff
        self.live = live or engine.live_servers
        self._group: tuple[tuple[str, ...], str] | None = None  # endpoints of the current group and its name

    @property
    def colocated(self) -> bool:
        return self.handoff.colocated

    @property
    def released(self) -> bool:
        return bool(self.handoff.released)

    def spec(self) -> TransportSpec:
        """The live servers' spec; a new weight-update group whenever the set of servers changed."""
        live = self.live()
        endpoints = tuple(s.endpoint for s in live)
        if self._group is None or self._group[0] != endpoints:
            self._group = (endpoints, _group_name())
        return self._spec_of(live, self._group[1])

    def _spec_of(self, slots: list[ServerAddress], group: str) -> TransportSpec:
        return spec_for(self.kind, slots, self.server_tp, self.trainer_ranks, group, backend=self.backend,
                        master_addr=self.master_addr, timeout_s=self.timeout_s)

    def restore(self, server: ServerAddress, version: int) -> dict[str, float]:
        """A restarted server (the engine's `restore_weights`: a server serving the original checkpoint) gets
        `version` through this transport from the trainer's ranks, like a push: over a weight-update group of
        its own (distributed; the next push forms a new group with every live server), or from the rank on its
        first GPU (ipc).

        Colocated with an offloaded trainer, the parameters would come back on every rank beside the other
        servers' KV pools and SGLang's runtime share, which fill the GPUs while they generate: the restore is
        deferred instead (`DEFERRED`: the engine gives the server no response until the next push, which reaches
        every live server, brings it the policy). Only when no other server serves does it happen at once, the
        server (holding no response) releasing its KV pool and runtime share for the send."""
        if self.colocated and self.handoff.offloads:
            waiting = getattr(self.engine, "awaiting_policy", set)()
            if any(s.index != server.index and s.index not in waiting for s in self.live()):
                return {DEFERRED: 1.0}
            with self.handoff.trainer_turn("rollout", ("params",), bucket=True):
                return self.trainer.send_weights(self._spec_of([server], _group_name()), version, self.bucket_bytes)
        with self.handoff.book.resident(("params",)), self.handoff.book.computing("bucket"):
            return self.trainer.send_weights(self._spec_of([server], _group_name()), version, self.bucket_bytes)

    def before_training(self) -> None:
        self.handoff.before_training()

    def push(self, version: int) -> dict[str, float]:
        def send() -> dict[str, float]:
            stats = self.trainer.send_weights(self.spec(), version, self.bucket_bytes)
            self.engine.committed(version)
            return stats

        return self.handoff.push(send)


def spec_for(kind: Literal["distributed", "ipc"], slots: list[ServerAddress], server_tp: int, trainer_ranks: int,
             group: str, *, backend: str | None = None, master_addr: str | None = None,
             timeout_s: float = 300.0) -> TransportSpec:
    """The spec of `slots` for a trainer of `trainer_ranks` ranks. Colocated, GPU by GPU: trainer rank r on the
    layout's GPU r, server i on GPUs i * tp .. (i + 1) * tp - 1 (slime's layout: rollout from offset 0), each of
    whose trainer ranks builds the payload of its GPU's server TP rank."""
    ranks = tuple(tuple(range(s.index * server_tp, (s.index + 1) * server_tp)) for s in slots)
    covered = kind == "ipc" and all(r < trainer_ranks for rs in ranks for r in rs)
    return TransportSpec(kind, tuple(s.endpoint for s in slots), tuple(s.curve for s in slots),
                         (server_tp,) * len(slots), group=group, backend=backend, master_addr=master_addr,
                         ipc_ranks=ranks if covered else (), timeout_s=timeout_s)


def _group_name() -> str:
    import uuid

    return f"rollverify-weights-{uuid.uuid4().hex[:12]}"


def weight_sync_for(launcher: str, placement: str, engine: Any, trainer: Any, *, server_tp: int = 1,
                    **kwargs: Any) -> TransportWeights | None:
    """The loop's `WeightSync` for a cluster layout; None for the local launcher (the loop's in-memory path)."""
    kind = transport_for(launcher, placement)
    if kind == "in_memory":
        return None
    return TransportWeights(engine, trainer, kind, server_tp=server_tp, **kwargs)
