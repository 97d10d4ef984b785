"""`TrainerMemory`: one trainer rank's parameters, gradients and optimizer state leave the device between
training phases and come back before the next (the colocated memory handoff, `rollverify.app.weight_transport.TransportWeights`).

It works on storages, as verl's Megatron workers do with the DDP buffers: Megatron-Core keeps the parameters
and the gradients in a few flat buffers, and every parameter, `main_grad`, bucket and distributed-optimizer shard
is a view into one of them. Resizing a buffer's storage to 0 frees its memory while every view (and every
object that holds one: the optimizer, the DDP buckets, the deferred output layer) stays valid; resizing it back
and copying the saved bytes in restores them bit for bit in place, so nothing has to be rebuilt or rebound.
slime reaches the same effect with torch_memory_saver, which pauses CUDA allocations below the tensors; that
needs its allocator hook and a GPU, whereas this runs the same code on CPU, where a test can see the storages
released and restored.

    kind        what                                                  while offloaded
    params      every model parameter's storage (the DDP param        bytes on the host (pinned on CUDA)
                buffers, or each parameter's own)
    grads       the DDP grad buffers (`main_grad`) and the optimizer  freed, zero-filled on reload: they hold
                main params' `.grad`                                  nothing between steps (train_step
                                                                      zeroes them before its backward)
    optimizer   the optimizer's main params (fp32 copies of bf16      bytes on the host
                weights) and its state (Adam moments, SGD momentum)

A storage belongs to the first kind of `KINDS` that names it (a fp32 model's distributed-optimizer shards are
views of the parameters: they move with `params`). Storages are told apart by their data pointer, so a kind is collected
while it is resident; a storage that is already empty is skipped.

The pinned host copies come from torch's caching host allocator, which keeps freed pinned blocks for reuse: a
reload hands them back to the system (`torch._C._host_emptyCache`), so that the host does not hold a copy of
the trainer's state through the training phase, a checkpoint's gather or a load (the host ledger,
rollverify.app.host_memory, counts them only while offloaded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

KINDS = ("params", "grads", "optimizer")


@dataclass
class _Stashed:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the bytes; None: freed (refilled with zeros)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (its current size)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TrainerMemory:
    """Offload and reload of one rank's `model` (DDP-wrapped) and `optimizer` (a Megatron-Core optimizer, or a
    chained one) by kind; see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.stashed: dict[str, list[_Stashed]] = {}

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(k for k in KINDS if k in self.stashed)

    def offload(self, kinds: Iterable[str] = KINDS) -> dict[str, float]:
        """Release the device storages of `kinds` (those not offloaded yet); returns the bytes released per
        kind (`offload/<kind>_bytes`)."""
        kinds = _checked(kinds)
        stats: dict[str, float] = {}
        with torch.no_grad():
            for kind in kinds:
                if kind in self.stashed:
                    continue
                others = {_key(s) for k in KINDS[:KINDS.index(kind)] for s in self._storages(k)}
                mine = [s for s in self._storages(kind) if _key(s) not in others]
                stash = []
                for s in mine:
                    host = None
                    if kind != "grads":
                        src = _bytes_of(s)
                        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=src.is_cuda)
                        host.copy_(src)
                    stash.append(_Stashed(s, s.nbytes(), host))
                    s.resize_(0)
                self.stashed[kind] = stash
                stats[f"offload/{kind}_bytes"] = float(sum(x.nbytes for x in stash))
        _release_cached()
        return stats

    def reload(self, kinds: Iterable[str] | None = None) -> dict[str, float]:
        """Bring `kinds` (default: every offloaded kind) back to the device in place; returns the bytes per
        kind (`reload/<kind>_bytes`)."""
        kinds = self.offloaded if kinds is None else _checked(kinds)
        stats: dict[str, float] = {}
        with torch.no_grad():
            for kind in kinds:
                stash = self.stashed.pop(kind, None)
                if stash is None:
                    continue
                stats[f"reload/{kind}_bytes"] = float(sum(_put_back(x) for x in stash))
                stash.clear()  # the host copies go: nothing else names them
        if stats:
            _release_host_cached()
        return stats

    @contextlib.contextmanager
    def resident(self, kinds: Iterable[str]) -> Iterator[None]:
        """`kinds` on the device inside the block; those that were offloaded go back out after it (a checkpoint
        or an export between phases leaves the handoff as it found it)."""
        brought = [k for k in _checked(kinds) if k in self.stashed]
        self.reload(brought)
        try:
            yield
        finally:
            if brought:
                self.offload(brought)

    # --- which storages --------------------------------------------------------------------------------------

    def _storages(self, kind: str) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages of `kind` as they are now."""
        if kind == "params":
            tensors = list(self.model.parameters())
        elif kind == "grads":
            tensors = [getattr(p, "main_grad", None) for p in self.model.parameters()]
            tensors += [p.grad for p in self._main_params()]
        else:
            tensors = list(self._main_params())
            for inner in self._inner():
                tensors += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
        seen: dict[tuple, torch.UntypedStorage] = {}
        for t in tensors:
            if t is None:
                continue
            s = t.untyped_storage()
            if s.nbytes() and _key(s) not in seen:
                seen[_key(s)] = s
        return list(seen.values())

    def _inner(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside the Megatron-Core one(s)."""
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _main_params(self) -> list[torch.Tensor]:
        return [p for inner in self._inner() for g in inner.param_groups for p in g["params"]]


def _put_back(x: _Stashed) -> int:
    """`x`'s storage at its size again, refilled from its host copy (zeros for gradients); its bytes."""
    x.storage.resize_(x.nbytes)
    dst = _bytes_of(x.storage)
    if x.host is None:
        dst.zero_()
    else:
        dst.copy_(x.host)
    return x.nbytes


def _key(s: torch.UntypedStorage) -> tuple:
    return s.device.type, s.device.index, s.data_ptr()


def _checked(kinds: Iterable[str]) -> list[str]:
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown trainer memory kind(s) {bad}: one of {', '.join(KINDS)}")
    return kinds


def _release_cached() -> None:
    """Hand the freed blocks back to the driver, where the servers can take them."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _release_host_cached() -> None:
    """Give the pinned blocks the reload freed back to the system (torch caches them otherwise)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
