"""CPU compatibility layer for SGLang 0.5.23: what its CPU path needs that PyPI does not provide.

Active only when no GPU is used (`use_cpu()`); `activate()` is idempotent and must run before `sglang` is
imported. It works through the environment, which SGLang's scheduler and detokenizer children inherit:

- `SGLANG_USE_CPU_ENGINE=1`: without it SGLang probes for vllm and then kills its parent process.
- `shim/` on PYTHONPATH: a pure-torch `sgl_kernel` stand-in (the ops SGLang's CPU path calls; see its
  docstring), which also gives the routed-experts capture plain host memory instead of `cudaHostRegister`
  and answers `torch.get_device_module()` with `torch.cpu` (SGLang's memory release calls it).

Nothing in site-packages is edited. `engine_kwargs()` are the engine arguments that work on CPU.
`retry_shm_handshake()` (applied by `activate()` here and by the shim in SGLang's children) retries the rebuild of
a tensor shared through torch's file_system strategy when torch's shared-memory manager misses its 1 s handshake.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"


def use_cpu() -> bool:
    """CPU mode where the run configured no GPU (ROLLVERIFY_DEVICE=cpu, `rollverify.devices.DEVICE_ENV`, set by
    its launcher); where it configured GPUs (cuda) never, and a process that cannot use CUDA then stops with
    `CudaUnavailable` (the node, the driver torch needs, the fix) instead of serving on the CPU. Unset: CPU mode
    unless a CUDA device is present."""
    from rollverify.devices import configured_device, require_cuda

    configured = configured_device()
    if configured == "cuda":
        require_cuda()
        return False
    if configured == "cpu":
        return True
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


def activate() -> bool:
    """Make this process and its future children able to run SGLang on CPU; returns whether it is active."""
    if not use_cpu():
        return False
    # Call it before this process imports sglang; servers run in child processes, which the environment below
    # reaches whatever this process already imported.
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    shim = str(SHIM_DIR)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([shim, *parts])
    if shim not in sys.path:
        sys.path.insert(0, shim)
    # CPU tensors sent to the scheduler for weight updates travel through torch.multiprocessing; the default
    # file-descriptor strategy makes the scheduler die with AuthenticationError.
    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    retry_shm_handshake()
    return True


SHM_HANDSHAKE = "Shared memory manager connection has timed out"
SHM_ATTEMPTS = 4


def retry_shm_handshake() -> None:
    """A tensor shared through the file_system strategy (the CPU path's weight payloads; CUDA tensors travel as
    IPC handles and never meet the manager) is rebuilt by registering its file with the sender's
    `torch_shm_manager`, whose answer libshm awaits for 1 s; a loaded CPU machine sometimes misses that, and the
    rebuild raises before anything is mapped or cached, so it is tried again (4 tries, 0.5-1.5 s apart). The
    wrapper keeps the original's module and name, so pickles name the same function as before. Idempotent."""
    from torch.multiprocessing import reductions

    original = reductions.rebuild_storage_filename
    if getattr(original, "rollverify_retry", False):
        return

    @functools.wraps(original)
    def rebuild_storage_filename(*args, **kwargs):
        for attempt in range(SHM_ATTEMPTS):
            try:
                return original(*args, **kwargs)
            except RuntimeError as e:
                if SHM_HANDSHAKE not in str(e) or attempt == SHM_ATTEMPTS - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    rebuild_storage_filename.rollverify_retry = True
    reductions.rebuild_storage_filename = rebuild_storage_filename


def engine_kwargs(**overrides) -> dict:
    """SGLang engine arguments for CPU: torch-native attention, float32 and a bounded KV cache."""
    kwargs = dict(
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        dtype="float32",
        mem_fraction_static=0.05,
        max_total_tokens=65536,
        disable_cuda_graph=True,
        skip_server_warmup=True,
    )
    kwargs.update(overrides)
    return kwargs
