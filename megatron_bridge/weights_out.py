"""`WeightsOut`: a trainer rank's weights leaving it in HF naming: streamed to a sink, to the servers through a
weight transport, or written as an HF folder.

Every rank takes part (the export gathers TP/EP/PP shards: a bucket at a time, one collective each, for a sync or
a transport, `convert.iter_hf_buckets`; also for an HF folder); only the ranks that hold a sink receive whole tensors, bucket by bucket.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_bridge import convert
from megatron_bridge.model import ModelArch

EXPORT_BUCKET_BYTES = 1 << 30  # an HF folder's shard (one safetensors file per bucket)


def is_driver() -> bool:
    """Whether this process is the trainer's rank 0 (or the only rank)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class WeightsOut:
    """The export side of one trainer rank over `model` (the DDP-wrapped Megatron-Core model) of `arch`, laid
    out as `layout`, loaded from the HF folder `model_path` (whose config and tokenizer an export copies)."""

    def __init__(self, model, arch: ModelArch, layout: convert.Layout, model_path: Path) -> None:
        self.model, self.arch, self.layout, self.model_path = model, arch, layout, model_path

    def iter_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time, on every rank (collective: all ranks iterate together)."""
        return convert.iter_hf_tensors(self.model, self.arch, self.layout, dtype=dtype)

    def export(self, out_dir: str | os.PathLike | None, version: int, dtype: torch.dtype | None = None):
        """An HF checkpoint folder (config, tokenizer files, safetensors) written by rank 0 at `out_dir`; its
        path. Without `out_dir`, the state as a dict of CPU tensors (small models, tests)."""
        if out_dir is None:
            return {k: v.detach().cpu().clone() for k, v in self.iter_hf_tensors(dtype)}
        from megatron_bridge.weight_sync import DiskSink, sync_buckets

        sink = DiskSink(out_dir, self.model_path) if is_driver() else None
        sync_buckets(self.iter_buckets(EXPORT_BUCKET_BYTES, dtype), sink, version, is_driver=is_driver())
        return Path(out_dir)

    def iter_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[list]:
        """The HF tensors in buckets of about `bucket_bytes`, one collective per bucket (`convert.iter_hf_buckets`),
        on every rank."""
        return convert.iter_hf_buckets(self.model, self.arch, self.layout, bucket_bytes, dtype)

    def sync(self, sink, version: int, bucket_bytes: int, dtype: torch.dtype | None = None) -> dict[str, float]:
        """Rank 0 pushes buckets of about `bucket_bytes` to `sink`, tagged `version`; other ranks only gather."""
        from megatron_bridge.weight_sync import sync_buckets

        return sync_buckets(self.iter_buckets(bucket_bytes, dtype), sink if is_driver() else None, version,
                            is_driver=is_driver())

    def send(self, spec, version: int, bucket_bytes: int, dtype: torch.dtype | None = None) -> dict[str, float]:
        """Each rank sends from its own `spec.open_sink(rank)` (`rollverify.app.weight_transport.TransportSpec`), or
        only joins the gathers; nothing crosses the driver."""
        from megatron_bridge.weight_sync import sync_buckets

        sink = spec.open_sink(dist.get_rank() if dist.is_initialized() else 0)
        return sync_buckets(self.iter_buckets(bucket_bytes, dtype), sink, version, is_driver=sink is not None)
