"""SGLang's tensor payloads (`update_weights_from_tensor`): its `MultiprocessingSerializer` (torch's
multiprocessing pickle), serialized again when torch's shared-memory manager handshake times out.

On CPU a tensor pickled for another process travels as a shared-memory file (torch's file_system sharing
strategy: a file descriptor cannot travel in bytes); torch starts its `torch_shm_manager` for the first one, and
that handshake can time out on a loaded CPU machine. Nothing has left the process then, so serializing the same
object again is safe. On a GPU tensors travel as CUDA IPC handles and never meet the manager.

The payload stays a handle to shared memory rather than the tensors' bytes: a colocated bucket (64 MiB by default)
must fit in a control message's header (16 MiB, base64), and the CPU path is the GPU path's stand-in (a handle to
the sender's memory, alive until the server has loaded it). Callers block while retrying (at most 3 s of sleep),
after a failed handshake that already blocked them longer. `serialize_flattened` is the payload of one
flattened bucket of the colocated transport (the trainer wing's `IpcSender` and `IpcPeer` are handed it by the application).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

log = logging.getLogger(__name__)

ATTEMPTS = 4


def serialize_tensors(obj: Any, attempts: int = ATTEMPTS) -> bytes:
    """`obj` (named tensors, or a flattened bucket with its metadata) as SGLang's serializer writes it."""
    from sglang.srt.utils import MultiprocessingSerializer

    for attempt in range(attempts):
        try:
            return MultiprocessingSerializer.serialize(obj)
        except RuntimeError as e:
            if "Shared memory manager" not in str(e) or attempt == attempts - 1:
                raise
            log.warning("serializing a weight bucket: %s; serializing it again", str(e).splitlines()[0])
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def serialize_flattened(flat: Any, meta: Any) -> bytes:
    """SGLang's payload for one flattened bucket (`flat`: one uint8 tensor; `meta`: its tensors' `names`,
    `dtypes`, `shapes` in order, megatron_bridge.weight_sync.BucketMeta): `{"flattened_tensor", "metadata"}` with
    SGLang's own classes (its unpickler refuses anything else), pickled the way its `MultiprocessingSerializer`
    does (`serialize_tensors`: retries torch's shared-memory handshake on CPU)."""
    import torch
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if flat.is_cuda:
        monkey_patch_torch_reductions()  # device index -> GPU UUID: the server sees other CUDA_VISIBLE_DEVICES
    else:  # a CPU tensor's pickle names a shared-memory file (a file descriptor cannot travel in bytes)
        torch.multiprocessing.set_sharing_strategy("file_system")
    metadata, offset = [], 0
    for name, dtype, shape in zip(meta.names, meta.dtypes, meta.shapes, strict=True):
        n = math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        metadata.append(FlattenedTensorMetadata(name=name, shape=torch.Size(shape), dtype=getattr(torch, dtype),
                                                start_idx=offset, end_idx=offset + n, numel=n))
        offset += n
    return serialize_tensors({"flattened_tensor": flat, "metadata": metadata})
