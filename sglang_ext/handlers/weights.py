"""Weight handlers: update_weights (staged buckets, applied at the commit), update_weights_from_disk, flush.

Each needs no generating responses. A weight update is checked in full against the served checkpoint (names,
shapes, dtypes, finite values) before any of it reaches SGLang: a refused update leaves the old weights serving
and discards anything staged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_ext.dispatch import Handler, Reply
from sglang_ext.protocol import (
    ErrorCode,
    FlushBody,
    Message,
    ProtocolError,
    UpdateWeightsBody,
    UpdateWeightsFromDiskBody,
)

if TYPE_CHECKING:
    from sglang_ext.server import ControlServer

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def check_tensor_specs(served: dict, specs: Iterable[tuple[str, str, Sequence[int]]], outcome: str) -> None:
    """Every (name, dtype, shape) of an update against the served checkpoint's `served` weights (name -> (shape,
    ...)); WEIGHT_INVALID naming the first five problems, then `outcome` (what the refusal left applied)."""
    problems = []
    for name, dtype, shape in specs:
        known = served.get(name)
        if known is None:
            problems.append(f"unknown weight name {name!r}")
        elif dtype not in WEIGHT_DTYPES:
            problems.append(f"weight {name!r} has dtype {dtype}; expected one of {list(WEIGHT_DTYPES)}")
        elif tuple(shape) != known[0]:
            problems.append(f"weight {name!r} has shape {list(shape)} but the model's is {list(known[0])}")
    if problems:
        raise ProtocolError(
            ErrorCode.WEIGHT_INVALID,
            "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "") + f". {outcome}",
            {"problems": problems[:100]},
        )


@dataclass
class StagedUpdate:
    """The buckets of one weight version received so far, waiting for the commit."""

    version: int
    next_bucket: int = 0
    buckets: list[list[tuple[str, Any]]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(len(b) for b in self.buckets)


class WeightHandlers:
    def __init__(self, server: ControlServer):
        self.server = server
        self.records = server.records
        self.staged: StagedUpdate | None = None

    def handlers(self) -> dict[str, Handler]:
        return {
            "update_weights": self.update_weights,
            "update_weights_from_disk": self.update_weights_from_disk,
            "flush": self.flush,
        }

    async def update_weights(self, body: UpdateWeightsBody, msg: Message) -> Reply:
        """Stage one bucket; the commit bucket applies every staged tensor at once and sets the version."""
        await self.records.require_idle("update_weights")
        staged = self._next_stage(body)
        self.staged = None  # re-set below only if this bucket is valid
        staged.buckets.append(self._decode_tensors(msg))
        staged.next_bucket += 1
        if not body.commit:
            self.staged = staged
            return {"version": self.records.version, "committed": False, "staged": staged.count}, None, None
        t0 = time.perf_counter()
        async with self.server.engine_calls.call():
            await self.server.engine.update_tensors(staged.buckets)
        self.records.version = body.version
        self.records.blocked = None  # a whole version is loaded
        reply = {
            "version": self.records.version,
            "committed": True,
            "tensors": staged.count,
            "engine_s": time.perf_counter() - t0,
        }
        return reply, None, None

    def _next_stage(self, body: UpdateWeightsBody) -> StagedUpdate:
        """The update this bucket continues (bucket 0 starts one); out of sequence discards what was staged."""
        staged = self.staged
        if body.bucket == 0:
            return StagedUpdate(version=body.version)
        if staged is None or staged.version != body.version or staged.next_bucket != body.bucket:
            self.staged = None
            expect = "bucket 0" if staged is None else f"bucket {staged.next_bucket} of version {staged.version}"
            raise ProtocolError(
                ErrorCode.WEIGHT_SEQUENCE,
                f"got bucket {body.bucket} of version {body.version} but expected {expect}; the staged update was "
                "discarded and the old weights keep serving",
            )
        return staged

    def _decode_tensors(self, msg: Message) -> list[tuple[str, Any]]:
        """Validate every tensor of a bucket against the served checkpoint, then build owned torch tensors."""
        import torch

        check_tensor_specs(
            self.server.info.weights,
            ((name, spec.dtype, spec.shape) for name, (spec, _raw) in msg.frames.items()),
            "Nothing was applied: the old weights keep serving",
        )
        problems = []
        out = []
        for name, (spec, raw) in msg.frames.items():
            dt = getattr(torch, spec.dtype)
            t = torch.frombuffer(bytearray(raw), dtype=dt) if raw.nbytes else torch.zeros(0, dtype=dt)
            if not _finite(t):
                problems.append(f"weight {name!r} holds non-finite values (NaN or inf)")
            out.append((name, t.reshape(spec.shape)))
        if problems:
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID,
                "; ".join(problems[:5]) + ". Nothing was applied: the old weights keep serving",
                {"problems": problems[:100]},
            )
        return out

    async def update_weights_from_disk(self, body: UpdateWeightsFromDiskBody, msg: Message) -> Reply:
        """Load a checkpoint folder whose weights match the served model's names, shapes and dtypes."""
        from sglang_ext.engine import ModelFolderError, inspect_model_folder

        await self.records.require_idle("update_weights_from_disk")
        try:
            other = inspect_model_folder(body.path)
        except (ModelFolderError, OSError, ValueError) as e:  # OSError/ValueError: an unusable path (NUL, too long)
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID, f"{_short_path(body.path)}: {e}; the old weights keep serving"
            ) from None
        problems = _checkpoint_mismatches(self.server.info.weights, other.weights)
        if problems:
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID,
                f"{body.path}: " + "; ".join(problems[:5]) + ". Nothing was applied: the old weights keep serving",
            )
        t0 = time.perf_counter()
        async with self.server.engine_calls.call():
            await self.server.engine.update_from_disk(str(other.path))
        self.records.version = body.version
        self.records.blocked = None  # a whole version is loaded
        return {"version": self.records.version, "committed": True, "engine_s": time.perf_counter() - t0}, None, None

    async def flush(self, body: FlushBody, msg: Message) -> Reply:
        await self.records.require_idle("flush")
        async with self.server.engine_calls.call():
            await self.server.engine.flush()
        return {"flushed": True}, None, None


def _checkpoint_mismatches(mine: dict, theirs: dict) -> list[str]:
    """How a checkpoint's weights ({name: (shape, dtype)}) differ from the served ones."""
    problems = [f"missing weight {n!r}" for n in mine if n not in theirs]
    problems += [f"unknown weight name {n!r}" for n in theirs if n not in mine]
    problems += [
        f"weight {n!r} has shape {list(theirs[n][0])} but the model's is {list(s)}"
        for n, (s, _) in mine.items()
        if n in theirs and theirs[n][0] != s
    ]
    problems += [
        f"weight {n!r} has dtype {d}; expected one of {list(WEIGHT_DTYPES)}"
        for n, (_, d) in theirs.items()
        if n in mine and d not in WEIGHT_DTYPES and mine[n][1] in WEIGHT_DTYPES
    ]
    return problems


def _finite(t: Any) -> bool:
    """Whether every value of a float tensor is finite. One sum in the tensor's own dtype (a vectorized pass, ~30 ms
    for 200 MB): NaN or inf anywhere makes it non-finite; only then the exact check, since a sum of finite values
    can overflow (float16 above 65504)."""
    import torch

    if not t.numel() or math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _short_path(path: str) -> str:
    return repr(path) if len(path) <= 200 else repr(path[:197] + "...")
