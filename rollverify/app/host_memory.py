"""What each node's host RAM holds for a plan: the formulas the host side of `MemoryBook` records, phase by phase.

The host ledger (rollverify.gpu_ledger.HostLedger) keeps one slot per node; `rollverify plan` replays the run on it
with the GPU ledger (rollverify.app.handoff.replay_run) and prints each node's peak per phase. Holders, per node:

    holder                                  bytes                                              held
    driver                                  DRIVER_BYTES (node 0)                              always
    driver responses                        the rollout's responses at full context:          from the rollout on
                                            (batch_groups x n + max_live) x context x
                                            per-token bytes (ids, log-probs, versions, MoE
                                            routes when replayed)
    object store (Ray)                      the train call's batch shares: all of them on     the train and verify
                                            the driver's node (`ray.put` there), each other    calls
                                            node the shares of its data-parallel ranks
    trainer rank r process                  HOST_PROCESS_BYTES                                 built
    trainer rank r offloaded params/optim.  the bytes the rank offloads (pinned host copies,    offloaded
                                            megatron_bridge.offload)
    trainer rank r checkpoint gather        a save, DP rank 0 of each data-parallel group:     checkpoint
                                            the group's whole fp32 main params + Adam moments
                                            of the rank's model-parallel shard (12 B/param,
                                            gathered over gloo) and the bf16 weights the
                                            writer copies to the host; one bucket's receive
                                            buffers
    trainer rank r checkpoint load          a load, every rank: the same 12 B/param of its     restore
                                            model-parallel shard (Megatron-Core fills it whole,
                                            then keeps its own slice)
    trainer rank r export bucket            rank 0: the HF export's 1 GiB shard (x2 in flight) export
    server i process                        HOST_PROCESS_BYTES per TP rank + SERVER_FRONTEND   served
                                            (tokenizer and detokenizer processes)
    server i weights backup                 its weights, with enable_weights_cpu_backup         served

The checkpoint rows follow Megatron-Core 0.16.1's distributed optimizer (`sharded_param_state_fully_reshardable`,
`get_parameter_state_dp_zero` in megatron/core/optimizer/distrib_optimizer.py): with
`distrib_optim_fully_reshardable_mem_efficient` (what megatron_bridge.checkpoint saves with) the state is
gathered with gloo on DP rank 0 only; without it every rank gathers it (`BEFORE`, for the comparison only). The
process figures are assumptions (a CUDA process with torch and its libraries loaded), not measurements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollverify.gpu_ledger import GiB

if TYPE_CHECKING:
    from rollverify.app.plan import Plan

HOST_PROCESS_BYTES = 4 * GiB  # a trainer rank's or SGLang scheduler's resident host memory (assumption)
SERVER_FRONTEND_BYTES = 2 * GiB  # a server's tokenizer manager and detokenizer processes (assumption)
DRIVER_BYTES = 4 * GiB  # `rollverify train` itself, without the responses it holds (assumption)
EXPORT_BUCKET_BYTES = 1 << 30  # megatron_bridge.weights_out.EXPORT_BUCKET_BYTES
RAY_MEMORY_THRESHOLD = 0.95  # Ray's memory monitor kills workers above this share of a node's RAM (its default)
DEFAULT_BUCKET_PARAMS = 40_000_000  # Megatron-Core DDP's bucket with overlap_grad_reduce: max(4e7, 1e6 x dp)
# per generated token the driver keeps: token id (int64), rollout and trainer log-probs (float32), version
# (int32), source, entropy; the MoE routes come on top (int32 per layer and top-k expert)
TOKEN_BYTES = 8 + 4 + 4 + 4 + 4 + 4
ROUTE_BYTES = 4


@dataclass(frozen=True)
class RankCheckpoint:
    """One trainer rank's host bytes in a checkpoint save and load."""

    gather: int  # the gathered optimizer state held through the save (0 where the rank holds none)
    staging: int  # the bf16 weights the writer copies to the host (what this rank writes)
    buffers: int  # one bucket's gather buffers (transient, within the gather)
    load: int  # a load's whole-shard optimizer state


@dataclass(frozen=True)
class HostFigures:
    """The host bytes of a plan's holders (module docstring), per process, rank or node."""

    driver: int
    responses: int  # the driver's responses at full context
    batch: int  # one train call's whole batch (what the driver puts in Ray's object store)
    rank_process: int
    server_process: int  # per server: its TP ranks' schedulers and its front end
    server_backup: int  # per server: a host copy of its weights (enable_weights_cpu_backup)
    offload: dict[str, int]  # kind -> bytes per rank while offloaded
    checkpoint: dict[int, RankCheckpoint]  # rank -> its checkpoint bytes
    export: int  # rank 0's export buckets
    shares: dict[int, int]  # rank -> the bytes of its batch share (distinct per data-parallel rank)


def data_parallel_rank(rank: int, tp: int, cp: int, dp: int) -> int:
    """The rank of global `rank` in its distributed optimizer's dense group (data x context parallel; Megatron-Core's
    order tp-cp-ep-dp-pp puts TP innermost)."""
    return (rank // tp) % (cp * dp)


def expert_data_parallel_rank(rank: int, etp: int, ep: int, expert_dp: int) -> int:
    """The expert data-parallel rank of global `rank` (experts' order etp-ep-dp-pp)."""
    return (rank // (etp * ep)) % expert_dp


def rank_checkpoint(dense: int, expert: int, *, rank: int, tp: int, cp: int, dp: int, ep: int, etp: int,
                    world: int, pp: int, weight_bytes: int, mem_efficient: bool, device: str = "cuda",
                    bucket_params: int | None = None) -> RankCheckpoint:
    """Host bytes of one rank's checkpoint, from its parameters of the dense and the expert buffers.

    Megatron-Core 0.16.1's `get_parameter_state_dp_zero` gathers, per buffer, the fp32 main params and both Adam
    moments (3 x 4 bytes per parameter of the model-parallel shard) into CPU tensors on DP rank 0 (`mem_efficient`:
    gloo, DP rank 0 only) or on every DP rank (all-gather); a bucket at a time, through each rank's local shards
    and, per key, receive buffers of the bucket's 4 bytes per parameter (gloo's flat buffer, the list, their
    concatenation). The DP rank 0 of the dense group writes the
    rank's weights, which the torch_dist writer first copies to the host from a GPU (`weight_bytes` per param;
    nothing to copy on CPU). A load (`is_loading`) allocates the whole shard's state on every rank.
    """
    expert_dp = world // (pp * ep * etp)
    dense_root = data_parallel_rank(rank, tp, cp, dp) == 0
    expert_root = expert_data_parallel_rank(rank, etp, ep, expert_dp) == 0
    gather = 0
    for params, root in ((dense, dense_root), (expert, expert_root)):
        if params and (root or not mem_efficient):
            gather += 12 * params
    largest = max(dense, expert)
    b = largest if bucket_params is None else min(bucket_params, largest)  # one bucket without overlap
    # every rank: its local shards of the bucket (3 keys); the receiver, per key: gloo's flat receive buffer,
    # the list it is copied into and their concatenation (without gloo: the list from the device and the
    # concatenation)
    buffers = 12 * b // max(dp * cp, 1) + ((12 if mem_efficient else 8) * b if gather else 0)
    staging = weight_bytes * (dense + expert) if (dense_root and device != "cpu") else 0
    return RankCheckpoint(gather, staging, buffers, 12 * (dense + expert))


def host_figures(plan: Plan, *, mem_efficient: bool = True) -> HostFigures:
    """The plan's host figures; `mem_efficient=False` gives the checkpoint rows of a save without Megatron-Core's
    memory-efficient option (every rank gathers)."""
    cfg, lay, a = plan.cfg, plan.layout, plan.arch
    r, t = cfg.rollout, plan.trainer
    per_token = TOKEN_BYTES + (ROUTE_BYTES * a.num_layers * a.top_k if a.moe and cfg.trainer.replay_train else 0)
    batch_tokens = r.batch_groups * r.n * plan.context
    p = t.params  # the fullest pipeline stage's rank
    world = lay.world_size
    overlap = cfg.cluster.gpus_per_node > 0  # the CUDA throughput paths overlap the gradient reduce
    bucket = max(DEFAULT_BUCKET_PARAMS, 1_000_000 * lay.dp * lay.cp) if overlap else None
    device = "cuda" if cfg.cluster.gpus_per_node else "cpu"
    ckpt = {rank: rank_checkpoint(p.dense, p.expert, rank=rank, tp=lay.tp, cp=lay.cp, dp=lay.dp, ep=lay.ep,
                                  etp=lay.etp, world=world, pp=lay.pp, weight_bytes=2, mem_efficient=mem_efficient,
                                  device=device, bucket_params=bucket)
            for rank in range(world)}
    share = batch_tokens * per_token // max(1, lay.dp)
    tp_size = plan.gpus_per_server
    backup = plan.server.weights * tp_size if cfg.servers.engine_args.extra.get("enable_weights_cpu_backup") else 0
    return HostFigures(
        driver=DRIVER_BYTES,
        responses=(r.batch_groups * r.n + r.max_live) * plan.context * per_token,
        batch=batch_tokens * per_token,
        rank_process=HOST_PROCESS_BYTES,
        server_process=HOST_PROCESS_BYTES * tp_size + SERVER_FRONTEND_BYTES,
        server_backup=backup,
        offload={"params": t.weights, "optimizer": t.optimizer},
        checkpoint=ckpt,
        export=2 * EXPORT_BUCKET_BYTES,
        shares={rank: share for rank in range(world)},
    )


def node_limit(ram_gib: float) -> int:
    """What the plan lets a node's host memory reach: Ray's memory monitor kills above RAY_MEMORY_THRESHOLD."""
    return int(ram_gib * GiB * RAY_MEMORY_THRESHOLD)


class HostBook:
    """The host side of `MemoryBook`: the plan's holders (module docstring) on a `HostLedger` of its nodes, one
    entry per kind of holder and node (a node's trainer ranks' offloaded parameters are one entry)."""

    def __init__(self, plan: Plan, *, strict: bool = True, mem_efficient: bool = True) -> None:
        from rollverify.gpu_ledger import HostLedger

        c = plan.cfg.cluster
        self.plan = plan
        self.figures = host_figures(plan, mem_efficient=mem_efficient)
        self.rank_node = {r: n for r, (n, _) in enumerate(plan.ranks)}
        self.server_node = {s.index: s.node for s in plan.servers}
        nodes = range(c.nodes) if c.gpus_per_node else ()
        self.ledger = HostLedger({n: node_limit(c.host_memory_gib) for n in nodes},
                                 ram={n: int(c.host_memory_gib * GiB) for n in nodes}, strict=strict)
        self.ray = c.launcher == "ray"
        self._by: dict[tuple[int, str], dict[int, int]] = {}  # (node, what) -> member -> bytes
        if self.enabled:
            self._set(0, "driver", "driver", 0, self.figures.driver)

    @property
    def enabled(self) -> bool:
        return bool(self.ledger.slots())

    def enter(self, phase: str) -> None:
        if not self.enabled:
            return
        self.ledger.enter(phase)
        if phase == "rollout":  # the driver keeps the responses from the first rollout on
            self._set(0, "driver responses", "driver", 0, self.figures.responses)

    # --- events ---------------------------------------------------------------------------------------------

    def server(self, i: int, on: bool) -> None:
        node = self.server_node.get(i)
        if node is None or not self.enabled:
            return
        f = self.figures
        self._set(node, "servers' processes", "server", i, f.server_process if on else None)
        if f.server_backup:
            self._set(node, "servers' weight backups", "server", i, f.server_backup if on else None)

    def trainer(self, on: bool) -> None:
        for r, node in self.rank_node.items():
            self._set(node, "trainer ranks' processes", "rank", r, self.figures.rank_process if on else None)

    def offloaded(self, kind: str, on: bool) -> None:
        """The ranks' pinned host copies of `kind` while it is off the GPU (gradients are freed, not copied)."""
        nbytes = self.figures.offload.get(kind)
        if nbytes is None:
            return
        for r, node in self.rank_node.items():
            self._set(node, f"trainer ranks' offloaded {kind}", "rank", r, nbytes if on else None)

    def reloaded(self, kinds: list[str]) -> None:
        """The ranks' host copies of `kinds` go back to the system together, once every kind is on the GPU again
        (`megatron_bridge.offload.TrainerMemory.reload` empties torch's host cache after the last): until then
        the node holds them all, which the phase's peak counts."""
        if not self.enabled:
            return
        self.ledger.settle()
        for kind in kinds:
            self.offloaded(kind, False)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """A train or verify call's batch in Ray's object store: every share on the driver's node, on each other
        node the shares of its ranks (ranks of one data-parallel rank share theirs)."""
        if not (self.enabled and self.ray):
            yield
            return
        per_node: dict[int, set[int]] = {}
        lay = self.plan.layout
        for r, node in self.rank_node.items():
            per_node.setdefault(node, set()).add(data_parallel_rank(r, lay.tp, lay.cp, lay.dp))
        share = next(iter(self.figures.shares.values()), 0)
        entries = {node: share * len(dps) for node, dps in per_node.items()}
        entries[0] = self.figures.batch
        for node, nbytes in entries.items():
            self._set(node, "object store (batch shares)", "node", node, nbytes)
        try:
            yield
        finally:
            for node in entries:
                self._set(node, "object store (batch shares)", "node", node, None)

    @contextlib.contextmanager
    def turn(self, phase: str) -> Iterator[None]:
        """The host working set of a checkpoint save (`checkpoint`), an HF export (`export`) or a checkpoint load
        (`restore`) for the block."""
        held: list[tuple[int, str, int]] = []
        if self.enabled:
            for r, node in self.rank_node.items():
                ck = self.figures.checkpoint[r]
                parts = {"checkpoint": {"checkpoint gather": ck.gather + ck.buffers, "checkpoint staging": ck.staging},
                         "restore": {"checkpoint load": ck.load},
                         "export": {"export buckets": self.figures.export if r == 0 else 0}}.get(phase, {})
                for what, nbytes in parts.items():
                    if nbytes:
                        self._set(node, f"trainer ranks' {what}", "rank", r, nbytes)
                        held.append((node, f"trainer ranks' {what}", r))
        try:
            yield
        finally:
            for node, what, r in held:
                self._set(node, what, "rank", r, None)

    # --- the plan's table -----------------------------------------------------------------------------------

    def render(self, order: tuple[str, ...] = ()) -> list[str]:
        """Each node's peak per phase (phases in `order` first) and the highest with its holders."""
        led = self.ledger
        led.settle()
        phases = [p for p in order if p in led.peaks] + [p for p in led.phases if p not in order]
        c = self.plan.cfg.cluster
        lines = [f"host RAM per node by phase (GiB of {c.host_memory_gib:g}; refused above "
                 f"{RAY_MEMORY_THRESHOLD:.0%}, where Ray's memory monitor kills)",
                 "  " + "node".ljust(12) + "".join(f"{p:>11}" for p in phases)]
        worst = None
        for slot in led.slots():
            row = {p: led.peaks[p][slot] for p in phases if slot in led.peaks[p]}
            lines.append("  " + f"node {slot[0]}".ljust(12)
                         + "".join(f"{row[p].nbytes / GiB:>11.1f}" if p in row else f"{'':>11}" for p in phases))
            for p, peak in row.items():
                if worst is None or peak.nbytes > worst[0]:
                    worst = (peak.nbytes, slot, p, peak)
        if worst is not None:
            share = worst[0] / (c.host_memory_gib * GiB)
            lines.append(f"  highest: node {worst[1][0]}, phase {worst[2]} ({share:.0%} of its RAM): "
                         f"{worst[3].describe()}")
        return lines

    # --- internals ------------------------------------------------------------------------------------------

    def _set(self, node: int, what: str, member_kind: str, member: int, nbytes: int | None) -> None:
        """Member `member` (a rank, a server, the node) of holder `what` on `node` holds `nbytes` (None: nothing);
        the ledger's entry is the members' sum, named with how many there are."""
        if not self.enabled:
            return
        members = self._by.setdefault((node, what), {})
        if nbytes is None:
            members.pop(member, None)
        else:
            members[member] = int(nbytes)
        slot = self.ledger.node(node)
        label = what if member_kind in ("node", "driver") else f"{what} ({len(members)})"
        for h in [h for h in self.ledger.holders(slot) if h == what or h.startswith(f"{what} (")]:
            self.ledger.drop(slot, h)
        if members:
            self.ledger.hold(slot, label, sum(members.values()))
