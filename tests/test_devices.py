"""A GPU run never becomes a CPU run: the device a run configures reaches every process (rollverify/devices.py),
the wings' CPU layers stay off where it says cuda, and a process that cannot use CUDA stops naming the node, the
driver torch needs and the fix. This machine has no GPU, so every CUDA check here meets the missing driver."""

from __future__ import annotations

import pytest

from rollverify.app.config import ConfigError, load_config
from rollverify.devices import (
    DEVICE_ENV,
    CudaUnavailable,
    cuda_problem,
    driver_version,
    required_driver,
    run_env,
)


def test_the_problem_names_the_node_the_driver_torch_needs_and_the_fix(monkeypatch, tmp_path):
    import torch

    assert torch.version.cuda == "13.0" and required_driver("13.0") == "580.65.06"  # the pinned torch's build
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build  (dvs-builder)"
                    "\nGCC version:  gcc version 12.2.0\n")
    assert driver_version(proc) == "535.104.05"
    monkeypatch.setattr("rollverify.devices.driver_version", lambda: "535.104.05")
    msg = cuda_problem("node 3 (10.0.0.4)")
    assert msg.startswith("node 3 (10.0.0.4) cannot use CUDA: torch 2.14.1")
    assert "built for CUDA 13.0 and needs NVIDIA driver 580.65.06 or newer; the node has driver 535.104.05" in msg
    assert msg.endswith("Fix: install NVIDIA driver 580.65.06 or newer on this node (or run a CPU run: "
                        "cluster.gpus_per_node=0)")


def test_a_process_told_cuda_stops_instead_of_falling_back(monkeypatch):
    from megatron_bridge import cpu_compat as megatron_compat
    from megatron_bridge.trainer import resolve_device
    from sglang_ext import cpu_compat as sglang_compat

    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(CudaUnavailable, match="cannot use CUDA: .*needs NVIDIA driver 580.65.06"):
        resolve_device("auto")  # the trainer, before any process group or model
    with pytest.raises(CudaUnavailable, match="cannot use CUDA"):
        sglang_compat.use_cpu()  # a server, before SGLang is imported
    assert not megatron_compat.needed()  # Megatron-Core's CPU routes are not for a GPU run
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device("auto") == "cpu" and sglang_compat.use_cpu() and megatron_compat.needed()
    monkeypatch.delenv(DEVICE_ENV)
    assert resolve_device("auto") == "cpu"  # unset: what torch sees (no GPU here)
    with pytest.raises(CudaUnavailable):
        resolve_device("cuda")


def test_the_run_environment_and_the_local_launchers_check():
    assert run_env(0) == {DEVICE_ENV: "cpu"}
    assert run_env(8, "ens5") == {DEVICE_ENV: "cuda", "GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens5"}
    cfg = load_config(None, ["cluster.gpus_per_node=1", "cluster.socket_ifname=ens5"])
    with pytest.raises(ConfigError, match=r"^cluster\.gpus_per_node: 1, but .* cannot use CUDA: .*Fix: install "):
        cfg.check_installed()  # before the run folder is claimed or any server starts
    load_config(None).check_installed()  # a CPU run needs no CUDA
    ray = load_config(None, ["cluster.launcher=ray", "cluster.gpus_per_node=2", "cluster.placement=disaggregated",
                             "cluster.rollout_gpus=1"])
    ray.check_installed()  # the Ray launcher checks every node instead (tests/test_ray_checks.py)


def test_ray_actors_get_the_runs_device_and_sockets():
    from rollverify.app.cluster import NOSET_CUDA, RayCluster
    from rollverify.app.plan import make_plan

    plan = make_plan(load_config(None, ["cluster.launcher=ray", "cluster.socket_ifname=eth1"]))
    env = RayCluster(plan, None, [], False).env
    assert env == {**NOSET_CUDA, DEVICE_ENV: "cpu", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
