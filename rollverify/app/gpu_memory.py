"""`MemoryBook`: what each server and trainer rank of a plan takes from its GPUs and its node's host RAM, recorded
on a `GpuLedger` and a `HostLedger`.

The book turns the run's events into ledger entries on the plan's (node, GPU) slots, with the byte figures of
`rollverify.app.plan` (one set of formulas for the plan's table, the replay and a running job):

    holder                              bytes per GPU                                 taken / given back
    server i context                    PROCESS_OVERHEAD                              start / stop
    server i weights                    its weights / tp                              start, resume / release
    server i kv_cache                   its KV pool (mem_fraction_static x the GPU    start, resume / release
                                        memory free at its start - weights, or
                                        max_total_tokens)
    server i runtime                    SGLang's runtime reserve (`sglang_runtime`):  start, resume / release
                                        CUDA graphs and forward activations, outside  (with the cuda_graph tag)
                                        mem_fraction_static
    trainer rank r context              PROCESS_OVERHEAD                              built
    trainer rank r params/grads/optim.  TrainerEstimate's                             built, reload / offload
    trainer rank r DDP copy-in          its bf16 params once more, while DDP copies   while built
                                        them into its buffer
    trainer rank r activations          TrainerEstimate.activations + logits          train_step
    trainer rank r forward              TrainerEstimate.forward                       compute_logprobs
    trainer rank r bucket               the push's bucket                             weight push, export

The host side (`host`, rollverify.app.host_memory.HostBook) records the same events in each node's RAM: the
processes, the trainer's offloaded state, a checkpoint's gathered optimizer state, the driver's responses and
Ray's object store. The driver calls the book where it asks a component to take or give back memory (server
launch, the handoff's release / resume / offload / reload, a trainer call that needs its state resident);
`replay` runs the run's own start-up and phase order (rollverify.app.handoff) on a book whose sides do nothing,
which is how `plan` gets each phase's peak. A CPU plan (`gpus_per_node: 0`) has no slots: the book records
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from rollverify.app.host_memory import HostBook
from rollverify.gpu_ledger import GiB, GpuLedger, Peak, Slot

if TYPE_CHECKING:
    from rollverify.app.plan import Plan

SERVER_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang 0.5.23's memory tags
SERVER_HOLDERS = {"weights": "weights", "kv_cache": "kv_cache", "cuda_graph": "runtime", "context": "context"}
TRAINER_KINDS = ("params", "grads", "optimizer")  # megatron_bridge.offload.KINDS
PHASES = ("start", "rollout", "train", "verify", "sync", "checkpoint", "export", "restore")
# Per GPU and process, outside what the formulas count: CUDA context, cuBLAS/NCCL workspaces (an assumption, not a
# measurement; held against mem_get_info on a GPU run). `rollverify.app.plan.PROCESS_OVERHEAD` is this figure.
PROCESS_OVERHEAD = int(1.5 * GiB)
MiB = 1 << 20


def sglang_runtime(engine_args: dict, gpu_bytes: int) -> int:
    """The memory SGLang 0.5.23 sets aside for its runtime outside `mem_fraction_static`: CUDA graphs and the
    forward's activations (`_handle_gpu_memory_settings` and `reserve_for_graph_mb` in
    sglang/srt/arg_groups/memory_hook.py, the reserve its default fraction leaves): 512 MiB, 1.5 MiB per token of
    a prefill chunk (`chunked_prefill_size`, at least 2048; its default by GPU memory), tp x pp / 8 GiB of
    communication buffers, 2 MiB per decode CUDA graph batch size up to `max_bs` (its default by GPU memory, at
    most `max_running_requests`) and 8 MiB per captured prefill size (prefill graphs are on by default on CUDA);
    at least 10 GiB on a GPU of more than 60 GiB. With the memory saver (a colocated run) SGLang sizes its KV pool
    before capturing its graphs, so they come out of this share."""
    ea = engine_args
    gpu_mib = gpu_bytes / MiB
    tp = int(ea.get("tp_size", 1))
    defaults = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
                (160 * 1024, 8192, 256, 512), (float("inf"), 16384, 512, 512))
    chunk, small_bs, large_bs = next((c, a, b) for limit, c, a, b in defaults if gpu_mib < limit)
    chunk = int(ea.get("chunked_prefill_size") or chunk)
    max_bs = small_bs if tp < 4 else large_bs
    if ea.get("max_running_requests"):
        max_bs = min(max_bs, int(ea["max_running_requests"]))
    graphs = 0.0
    if not ea.get("disable_cuda_graph"):
        if not ea.get("disable_decode_cuda_graph"):
            graphs += 2 * max_bs
        if not ea.get("disable_prefill_cuda_graph"):
            graphs += 8 * len(prefill_graph_sizes(chunk))
    reserve = 512 + max(chunk, 2048) * 1.5 + tp * int(ea.get("pp_size", 1)) / 8 * 1024 + graphs
    if gpu_mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return int(reserve * MiB)


def prefill_graph_sizes(max_bs: int) -> list[int]:
    """SGLang's prefill CUDA graph token counts up to `max_bs` (`generate_prefill_cuda_graph_batch_sizes`)."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_bs + 1, 512)]
    return [x for x in sizes if x <= max_bs]


class MemoryBook:
    """The plan's servers and trainer ranks on a ledger of its GPUs; see the module docstring."""

    def __init__(self, plan: Plan, *, strict: bool = True, bucket_bytes: int = 64 << 20,
                 ledger: GpuLedger | None = None) -> None:
        c, s, t = plan.cfg.cluster, plan.server, plan.trainer
        self.plan = plan
        self.server_slots = {x.index: [(x.node, g) for g in x.gpus] for x in plan.servers}
        self.rank_slots = {r: (n, g) for r, (n, g) in enumerate(plan.ranks) if g is not None}
        slots = sorted({*self.rank_slots.values(), *(g for v in self.server_slots.values() for g in v)})
        self.ledger = ledger or GpuLedger({g: int(c.gpu_memory_gib * GiB) for g in slots}, strict=strict)
        ea = plan.cfg.servers.engine_args
        self.server_bytes = {
            "context": PROCESS_OVERHEAD,
            "weights": s.weights,
            "kv_cache": s.kv_pool_tokens * s.kv_bytes_per_token,
            "cuda_graph": sglang_runtime(ea.args(), int(c.gpu_memory_gib * GiB)),  # the runtime share, graphs included
        }
        self.trainer_bytes = {"context": PROCESS_OVERHEAD, "params": t.weights, "grads": t.gradients,
                              "optimizer": t.optimizer}
        self.activations, self.forward, self.bucket_bytes = t.activations + t.logits, t.forward, bucket_bytes
        self.offloaded: set[str] = set()  # the trainer's kinds off the GPU (mirrors megatron_bridge.offload)
        self.released: dict[int, set[str]] = {}  # server -> tags released
        self.host = HostBook(plan, strict=strict)

    @property
    def enabled(self) -> bool:
        return bool(self.ledger.slots())

    def enter(self, phase: str) -> None:
        self.ledger.enter(phase)
        self.host.enter(phase)

    @property
    def phase(self) -> str:
        return self.ledger.phase

    # --- servers --------------------------------------------------------------------------------------------

    def server_started(self, i: int) -> None:
        """Server i serves: its context, weights, KV pool and CUDA graphs on each of its GPUs."""
        self.released[i] = set()
        for name in ("context", *SERVER_TAGS):
            self._servers([i], name, True)
        self.host.server(i, True)

    def servers_released(self, tags: Iterable[str], servers: Iterable[int] | None = None) -> None:
        for i in self._which(servers):
            for tag in tags:
                self.released[i].add(tag)
                self._servers([i], tag, False)

    def servers_resumed(self, tags: Iterable[str], servers: Iterable[int] | None = None) -> None:
        for i in self._which(servers):
            for tag in tags:
                self.released[i].discard(tag)
                self._servers([i], tag, True)

    def _which(self, servers: Iterable[int] | None) -> list[int]:
        return list(self.released) if servers is None else list(servers)

    def _servers(self, servers: list[int], name: str, on: bool) -> None:
        for i in servers:
            for slot in self.server_slots.get(i, []):
                if on:
                    self.ledger.hold(slot, f"server {i} {SERVER_HOLDERS[name]}", self.server_bytes[name])
                else:
                    self.ledger.drop(slot, f"server {i} {SERVER_HOLDERS[name]}")

    # --- trainer --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def trainer_building(self) -> Iterator[None]:
        """Megatron's DDP allocates its parameter and gradient buffers and copies the parameters in (both copies
        held for a moment), then the optimizer its fp32 main parameters and moments."""
        self.offloaded.clear()
        self.host.trainer(True)
        for name in ("context", "params", "grads"):
            self._ranks(name, self.trainer_bytes[name])
        self._ranks("DDP copy-in", self.trainer_bytes["params"])
        yield
        self._ranks("DDP copy-in", None)
        self._ranks("optimizer", self.trainer_bytes["optimizer"])

    def trainer_offloaded(self, kinds: Iterable[str]) -> None:
        for k in kinds:
            self.offloaded.add(k)
            self._ranks(k, None)
            self.host.offloaded(k, True)

    def trainer_reloaded(self, kinds: Iterable[str] | None = None) -> None:
        wanted = set(self.offloaded if kinds is None else kinds)
        back = [k for k in TRAINER_KINDS if k in wanted]  # one order, whatever order the set holds them in
        for k in back:
            self.offloaded.discard(k)
            self._ranks(k, self.trainer_bytes[k])
        self.host.reloaded(back)

    @contextlib.contextmanager
    def resident(self, kinds: Iterable[str]) -> Iterator[None]:
        """The trainer brings `kinds` back for one call and offloads them after (`TrainerMemory.resident`)."""
        brought = [k for k in kinds if k in self.offloaded]
        self.trainer_reloaded(brought)
        try:
            yield
        finally:
            self.trainer_offloaded(brought)

    @contextlib.contextmanager
    def computing(self, what: str) -> Iterator[None]:
        """A trainer call's working memory for its duration: `train` (activations of one micro-batch and its
        logits chunk), `forward` (a no-grad forward), `bucket` (a gathered weight bucket)."""
        name, nbytes = {"train": ("activations", self.activations), "forward": ("forward", self.forward),
                        "bucket": ("bucket", self.bucket_bytes)}[what]
        self._ranks(name, nbytes)
        try:
            with self.host.batch() if what in ("train", "forward") else contextlib.nullcontext():
                yield
        finally:
            self._ranks(name, None)

    @contextlib.contextmanager
    def trainer_turn(self, phase: str) -> Iterator[None]:
        """A checkpoint's, an export's or a restore's host working set for the block (`HostBook.turn`)."""
        with self.host.turn(phase):
            yield

    def _ranks(self, name: str, nbytes: int | None) -> None:
        for r, slot in self.rank_slots.items():
            if nbytes is None:
                self.ledger.drop(slot, f"trainer rank {r} {name}")
            else:
                self.ledger.hold(slot, f"trainer rank {r} {name}", nbytes)

    # --- measurement ----------------------------------------------------------------------------------------

    def compare(self, rank: int, report: dict) -> None:
        """A trainer rank's `memory_report` (CUDA only: torch.cuda.memory_allocated, mem_get_info) against the
        ledger: the rank's own entries, and everything on its GPU."""
        slot = self.rank_slots.get(rank)
        if slot is None or not report:
            return
        mine = sum(b for h, b in self.ledger.holders(slot).items() if h.startswith(f"trainer rank {rank} ")
                   and not h.endswith(" context"))
        self.ledger.compare(slot, int(report["allocated"]), mine, what=f"trainer rank {rank} memory_allocated")
        self.ledger.compare(slot, int(report["total"] - report["free"]), what="in use (mem_get_info)")

    # --- the plan's table -----------------------------------------------------------------------------------

    def gpu_classes(self) -> dict[str, list[Slot]]:
        """Slots grouped by what they host (trainer rank, a server's first GPU or another of its GPUs)."""
        first = {g[0] for g in self.server_slots.values() if g}
        ranks = set(self.rank_slots.values())
        out: dict[str, list[Slot]] = {}
        for slot in self.ledger.slots():
            server = [i for i, gs in self.server_slots.items() if slot in gs]
            what = ["trainer rank"] if slot in ranks else []
            if server:
                what.append("server (TP rank 0)" if slot in first else "server (TP rank > 0)")
            out.setdefault(" + ".join(what), []).append(slot)
        return out

    def phase_peaks(self) -> dict[str, dict[str, Peak]]:
        """class -> phase -> the largest peak over that class's slots."""
        self.ledger.settle()
        out: dict[str, dict[str, Peak]] = {}
        for name, slots in self.gpu_classes().items():
            row = out[name] = {}
            for phase, peaks in self.ledger.peaks.items():
                got = [peaks[s] for s in slots if s in peaks]
                if got:
                    row[phase] = max(got, key=lambda p: p.nbytes)
        return out

    def render(self) -> list[str]:
        phases = [p for p in PHASES if p in self.ledger.peaks] + [p for p in self.ledger.phases if p not in PHASES]
        cap = self.plan.cfg.cluster.gpu_memory_gib
        classes = self.gpu_classes()
        labels = {name: f"{name} ({len(slots)} GPUs)" for name, slots in classes.items()}
        width = max(len(x) for x in labels.values()) + 1
        lines = [f"peak per GPU by phase (GiB of {cap}), replayed through the run's start-up and phase order",
                 "  " + "GPU".ljust(width) + "".join(f"{p:>11}" for p in phases)]
        worst: tuple[float, str, str, Peak] | None = None
        for name, row in self.phase_peaks().items():
            cells = "".join(f"{row[p].nbytes / GiB:>11.1f}" if p in row else f"{'':>11}" for p in phases)
            lines.append("  " + labels[name].ljust(width) + cells)
            for p, peak in row.items():
                if worst is None or peak.nbytes > worst[0]:
                    worst = (peak.nbytes, name, p, peak)
        if worst is not None:
            lines.append(f"  highest: {worst[1]}, phase {worst[2]}: {worst[3].describe()}")
            lines.append(f"  margin: {self.margin() / GiB:.1f} GiB, the least a GPU keeps free in any phase (a "
                         f"restarted server's restore beside generating servers included)")
        return lines

    def margin(self) -> int:
        """The least any GPU keeps free in any phase of the replay (its capacity less its phase peak): the
        margin `plan` states for memory the ledger does not see (fragmentation, NCCL buffers beyond the
        context's share)."""
        self.ledger.settle()
        return min((self.ledger.capacity[s] - p.nbytes for peaks in self.ledger.peaks.values()
                    for s, p in peaks.items()), default=0)
