"""`GpuLedger`: who holds how many bytes of each GPU, phase by phase; `HostLedger`: the same of each node's RAM.

The ledger is keyed by GPU slot (node, local GPU). Each holder of GPU memory (a server's weights, KV pool, CUDA
graphs, a trainer rank's parameters, gradients, optimizer state, activations, a process's CUDA context) is an
entry `holder -> bytes` on the slots it occupies; `hold` sets an entry and `drop` removes it. The run's driver
records every take and give-back where it asks a component to do it (rollverify.app.gpu_memory.MemoryBook), so
the ledger's state is what the GPUs hold if the estimates are right; `rollverify plan` replays the same
sequence to print each phase's peak before anything starts.

A `hold` that makes a slot exceed its capacity raises `GpuMemoryError` naming the phase, the slot and every
holder's bytes (with `strict=False` it is kept in `overflows` instead: the plan reports all of them). On CUDA,
`compare` holds a measured figure (torch.cuda.memory_allocated, or what mem_get_info says is in use) against the
ledger and warns, once per phase, slot and kind of measurement, when the measurement is above the ledger by
more than `margin`.

`HostLedger` keys the same entries by node (slot `(node, HOST)`): the host memory each process, buffer and
transfer holds on a node (the trainer's offloaded state, a checkpoint's gathered optimizer state, the driver's
batch, Ray's object store), with `HostMemoryError` naming the phase, the node and every holder's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

GiB = 1 << 30
Slot = tuple[int, int]  # (node, local GPU); (node, HOST) on a HostLedger
HOST = -1  # the "GPU" index of a node's host RAM

log = logging.getLogger(__name__)


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def slot_name(slot: Slot) -> str:
    return f"node {slot[0]} host RAM" if slot[1] == HOST else f"node {slot[0]} GPU {slot[1]}"


class GpuMemoryError(RuntimeError):
    """A GPU would hold more than its memory; the message names the phase, the GPU and each holder's bytes."""


class HostMemoryError(GpuMemoryError):
    """A node's host RAM would hold more than its limit; the message names the phase, the node and each holder."""


@dataclass(frozen=True)
class Peak:
    """The most a slot held during a phase, and who held it then."""

    nbytes: int
    holders: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        return ", ".join(f"{h} {gib(b)}" for h, b in self.holders if b)


class GpuLedger:
    """Bytes per holder on each GPU slot; see the module docstring."""

    error = GpuMemoryError

    def __init__(self, capacity: Mapping[Slot, int], *, strict: bool = True, margin: int = 2 * GiB,
                 warn: Callable[[str], None] | None = None) -> None:
        self.capacity = dict(capacity)
        self.strict, self.margin = strict, margin
        self.warn = warn or log.warning
        self.phase = "start"
        self.phases: list[str] = ["start"]
        self._held: dict[Slot, dict[str, int]] = {s: {} for s in self.capacity}
        self.peaks: dict[str, dict[Slot, Peak]] = {"start": {}}
        self.overflows: list[str] = []
        self._warned: set[tuple[str, Slot, str]] = set()

    # --- phases ---------------------------------------------------------------------------------------------

    def enter(self, phase: str) -> None:
        """Later entries belong to `phase`. A phase's peak on a slot is the most it held after an entry of that
        phase, or, where the phase made none there, what it held through the phase."""
        self.settle()
        self.phase = phase
        if phase not in self.peaks:
            self.peaks[phase] = {}
            self.phases.append(phase)

    def settle(self) -> None:
        """The current phase's peak on every slot it made no entry on: what the slot holds now."""
        for slot in self._held:
            if slot not in self.peaks[self.phase]:
                self._note(slot)

    # --- entries --------------------------------------------------------------------------------------------

    def hold(self, slot: Slot, holder: str, nbytes: int) -> None:
        """`holder` holds `nbytes` on `slot` (replacing what it held there); raises GpuMemoryError (strict) when
        the slot then holds more than its capacity."""
        if slot not in self._held:
            raise KeyError(f"{slot_name(slot)} is not a GPU of this ledger")
        entries = self._held[slot]
        entries[holder] = int(nbytes)
        total = sum(entries.values())
        self._note(slot)
        if total > self.capacity[slot]:
            msg = (f"phase {self.phase}: {slot_name(slot)} would hold {gib(total)} of its "
                   f"{gib(self.capacity[slot])}: {self._describe(entries)}")
            if self.strict:
                del entries[holder]
                raise self.error(msg)
            self.overflows.append(msg)

    def drop(self, slot: Slot, holder: str) -> None:
        self._held[slot].pop(holder, None)

    def holders(self, slot: Slot) -> dict[str, int]:
        return dict(self._held[slot])

    def total(self, slot: Slot) -> int:
        return sum(self._held[slot].values())

    def slots(self) -> list[Slot]:
        return list(self._held)

    # --- measurement ----------------------------------------------------------------------------------------

    def compare(self, slot: Slot, measured: int, counted: int | None = None, what: str = "measured") -> bool:
        """Warn (once per phase, slot and `what`) when `measured` bytes exceed the ledger's `counted` (default:
        the slot's total) by more than `margin`; returns whether it warned."""
        counted = self.total(slot) if counted is None else counted
        key = (self.phase, slot, what)
        if measured - counted <= self.margin or key in self._warned:
            return False
        self._warned.add(key)
        self.warn(f"GPU memory ledger, phase {self.phase}, {slot_name(slot)}: {what} {gib(measured)}, the ledger "
                  f"counts {gib(counted)} ({gib(measured - counted)} more than its margin of {gib(self.margin)} "
                  f"allows): {self._describe(self._held[slot])}")
        return True

    # --- internals ------------------------------------------------------------------------------------------

    def _note(self, slot: Slot) -> None:
        total = self.total(slot)
        best = self.peaks[self.phase].get(slot)
        if best is None or total > best.nbytes:
            self.peaks[self.phase][slot] = Peak(total, tuple(sorted(self._held[slot].items())))

    @staticmethod
    def _describe(entries: Mapping[str, int]) -> str:
        return ", ".join(f"{h} {gib(b)}" for h, b in sorted(entries.items()) if b) or "nothing"


class HostLedger(GpuLedger):
    """Bytes per holder in each node's host RAM (slot `(node, HOST)`); `capacity` is what the ledger allows a
    node (the plan's limit: its RAM times the share Ray's memory monitor leaves), `ram` the node's RAM."""

    error = HostMemoryError

    def __init__(self, limit: Mapping[int, int], *, ram: Mapping[int, int] | None = None, strict: bool = True,
                 margin: int = 8 * GiB, warn: Callable[[str], None] | None = None) -> None:
        super().__init__({(n, HOST): b for n, b in limit.items()}, strict=strict, margin=margin, warn=warn)
        self.ram = {(n, HOST): b for n, b in (ram or limit).items()}

    def node(self, node: int) -> Slot:
        return (node, HOST)
