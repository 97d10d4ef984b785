"""Which device a process of a run uses, and why CUDA is not usable where a GPU run needs it.

A run's launcher sets `ROLLVERIFY_DEVICE` (`DEVICE_ENV`) in every trainer rank and server it starts: `cuda` where
the config places GPUs (`cluster.gpus_per_node > 0`), `cpu` where it does not. The wings read it
(`megatron_bridge.trainer.resolve_device`, `sglang_ext.cpu_compat.use_cpu`): their CPU compatibility layers
activate only for `cpu`, and a process told `cuda` that cannot use CUDA stops with `CudaUnavailable` instead of
falling back to the CPU. Without the variable (a library call, a test, `make demo`) the process uses CUDA where
torch sees it, else the CPU.

`cuda_problem` says what is wrong on this node: the driver version it finds (/proc/driver/nvidia/version, else
`nvidia-smi`), the one torch's CUDA build needs, torch's own complaint, and the fix. torch 2.14.1 from PyPI is
the CUDA 13.0 build, which needs driver R580 (580.65.06) or newer.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import warnings
from pathlib import Path

DEVICE_ENV = "ROLLVERIFY_DEVICE"
# the driver each CUDA toolkit's GA release needs on Linux (NVIDIA's CUDA toolkit release notes, table 3)
MIN_DRIVER = {"13.0": "580.65.06", "12.9": "575.51.03", "12.8": "570.26", "12.6": "560.28.03", "12.4": "550.54.14",
              "12.1": "530.30.02", "11.8": "520.61.05"}


class CudaUnavailable(RuntimeError):
    """A process told to use CUDA cannot: the message names the node, the driver it needs and the fix."""


def configured_device() -> str | None:
    """`cpu` or `cuda` as the launcher set it, None when unset (or set to anything else)."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    return value if value in ("cpu", "cuda") else None


def node_name() -> str:
    """This machine as a message names it: host name and address."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "address unknown"
    return f"{host} ({address})"


DRIVER_FILE = Path("/proc/driver/nvidia/version")


def driver_version(proc: Path = DRIVER_FILE) -> str | None:
    """The NVIDIA kernel driver's version on this machine (`proc`, else nvidia-smi), None without one."""
    try:
        text = proc.read_text()
        m = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return first[0].strip() if out.returncode == 0 and first else None


def required_driver(cuda: str | None) -> str | None:
    """The driver version torch's CUDA build `cuda` ("13.0") needs, None when not known here."""
    if cuda is None:
        return None
    if cuda in MIN_DRIVER:
        return MIN_DRIVER[cuda]
    major = cuda.split(".")[0]
    known = sorted((v for v in MIN_DRIVER if v.split(".")[0] == major), key=lambda v: [int(x) for x in v.split(".")])
    return MIN_DRIVER[known[0]] if known else None


def cuda_problem(where: str | None = None) -> str | None:
    """Why this process cannot use CUDA (None: it can), naming `where` (default: this node), what torch needs,
    what the node has, and the fix."""
    import torch

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ok = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if ok:
        return None
    cuda = torch.version.cuda
    need = required_driver(cuda)
    found = driver_version()
    torch_says = "; ".join(str(w.message).splitlines()[0] for w in said)
    if cuda is None:
        build = f"torch {torch.__version__} is a build without CUDA"
        fix = "install the CUDA build of torch (make setup PROFILE=gpu)"
    else:
        build = f"torch {torch.__version__} is built for CUDA {cuda}" + (
            f" and needs NVIDIA driver {need} or newer" if need else "")
        fix = (f"install NVIDIA driver {need} or newer on this node" if need else "install a driver for CUDA "
               f"{cuda} on this node") + " (or run a CPU run: cluster.gpus_per_node=0)"
    has = f"driver {found}" if found else "no NVIDIA driver (no /proc/driver/nvidia/version, no nvidia-smi)"
    return (f"{where or node_name()} cannot use CUDA: {build}; the node has {has}"
            + (f"; torch: {torch_says}" if torch_says else "") + f". Fix: {fix}")


def require_cuda(where: str | None = None) -> None:
    """Raise `CudaUnavailable` (the `cuda_problem`) where this process cannot use CUDA."""
    problem = cuda_problem(where)
    if problem is not None:
        raise CudaUnavailable(problem)


def device_report() -> dict[str, str | None]:
    """What a node says for the Ray launcher's check: its name and its CUDA problem (None: CUDA works)."""
    name = node_name()
    return {"node": name, "problem": cuda_problem(name)}


def run_env(gpus_per_node: int, socket_ifname: str | None = None) -> dict[str, str]:
    """The environment a run gives every trainer rank and server: the device (`DEVICE_ENV`) and, on nodes with
    several network interfaces, the one gloo's and NCCL's sockets use."""
    env = {DEVICE_ENV: "cuda" if gpus_per_node > 0 else "cpu"}
    if socket_ifname:
        env.update(GLOO_SOCKET_IFNAME=socket_ifname, NCCL_SOCKET_IFNAME=socket_ifname)
    return env
