"""CPU compatibility layer for SGLang 0.5.23: what its CPU path needs that PyPI does not provide.

Active only when no GPU is used (`use_cpu()`); `activate()` is idempotent and must run before `sglang` is
imported. It works through the environment, which SGLang's scheduler and detokenizer children inherit:

- `SGLANG_USE_CPU_ENGINE=1`: without it SGLang probes for vllm and then kills its parent process.
- `shim/` on PYTHONPATH: a pure-torch `sgl_kernel` stand-in (the ops SGLang's CPU path calls; see its
  docstring), which also gives the routed-experts capture plain host memory instead of `cudaHostRegister`
  and answers `torch.get_device_module()` with `torch.cpu` (SGLang's memory release calls it).

Nothing in site-packages is edited. `engine_kwargs()` are the engine arguments that work on CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"


def use_cpu() -> bool:
    """CPU mode unless a CUDA device is present; ROLLVERIFY_DEVICE=cpu|cuda overrides."""
    forced = os.environ.get("ROLLVERIFY_DEVICE", "").lower()
    if forced in ("cpu", "cuda"):
        return forced == "cpu"
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
    return True


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
