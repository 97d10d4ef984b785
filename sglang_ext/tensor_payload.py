"""SGLang's tensor payloads (`update_weights_from_tensor`): its `MultiprocessingSerializer` (torch's
multiprocessing pickle), serialized again when torch's shared-memory manager handshake times out.

On CPU a tensor pickled for another process travels as a shared-memory file (torch's file_system sharing
strategy: a file descriptor cannot travel in bytes); torch starts its `torch_shm_manager` for the first one, and
that handshake can time out on a loaded CPU machine. Nothing has left the process then, so serializing the same
object again is safe. On a GPU tensors travel as CUDA IPC handles and never meet the manager.

The payload stays a handle to shared memory rather than the tensors' bytes: a colocated bucket (64 MiB by default)
must fit in a control message's header (16 MiB, base64), and the CPU path is the GPU path's stand-in (a handle to
the sender's memory, alive until the server has loaded it). Callers block while retrying (at most 3 s of sleep),
after a failed handshake that already blocked them longer. This module imports nothing of the project, so
`megatron_bridge.weight_sync` may use it without an import cycle.
"""

from __future__ import annotations

import logging
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
