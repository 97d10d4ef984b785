"""The Ray launcher's start-up checks on a simulated 2-node Ray cluster (rollverify/app/cluster.py): a GPU run on
nodes whose torch cannot use CUDA stops before anything is reserved; the run folder must be storage every node
shares; old checkpoints are removed on every node.

The cluster: a driver-only head, node A (`ray.cluster_utils.Cluster.add_node`) and node B, a `ray start` in a
mount namespace of its own (`unshare -m`, needs root) where a tmpfs hides the folder `masked`: node B does not
see what the driver writes there, as a node without the shared file system would not. Both declare one GPU, which
this machine does not have: a GPU plan's device check then meets what a node with a driver too old for torch's
CUDA build meets (torch.cuda.is_available() false).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollverify.app.config import load_config

# a Ray head, two nodes and tasks that import torch on each: ~1-5 min here
pytestmark = [pytest.mark.slow, pytest.mark.system]

RAY = Path(sys.executable).parent / "ray"


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt && umount /mnt"],
                          capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """(head address, the folder node B does not see, node B's process), with ray connected to the head."""
    import psutil
    import ray
    from ray.cluster_utils import Cluster

    if not _can_unshare():
        pytest.skip("a node without the shared folder needs a mount namespace (root, unshare)")
    masked = tmp_path_factory.mktemp("masked")
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0"}
    saved = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    # Ray gives a node 30 s to register (ray/_private/node.py); on the loaded shared machine a start can miss it
    cluster = _tries(lambda: Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}))
    log = open(tmp_path_factory.mktemp("logs") / "node_b.log", "w")  # noqa: SIM115 - closed at teardown
    node_b = None
    try:
        _tries(lambda: cluster.add_node(num_cpus=2, num_gpus=1, resources={"rv_check_a": 1}))
        start = (f"mount -t tmpfs tmpfs {masked} && exec {RAY} start --address {cluster.address} --num-cpus 2 "
                 f"--num-gpus 1 --resources '{json.dumps({'rv_check_b': 1})}' --disable-usage-stats --block")
        ray.init(address=cluster.address, log_to_driver=False)
        for _ in range(3):
            node_b = subprocess.Popen(["unshare", "-m", "sh", "-c", start], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)
            deadline = time.monotonic() + 300
            while len([n for n in ray.nodes() if n["Alive"]]) < 3 and node_b.poll() is None:
                assert time.monotonic() < deadline, Path(log.name).read_text()[-2000:]
                time.sleep(1)
            if node_b.poll() is None:
                break
        assert node_b.poll() is None, Path(log.name).read_text()[-2000:]
        yield cluster.address, masked
    finally:
        ray.shutdown()
        if node_b is not None:
            tree = psutil.Process(node_b.pid).children(recursive=True) if node_b.poll() is None else []
            node_b.terminate()
            try:
                node_b.wait(60)
            except subprocess.TimeoutExpired:
                node_b.kill()
            for p in tree:  # what `ray start --block` started in its namespace, by pid
                if p.is_running():
                    p.kill()
        cluster.shutdown()
        log.close()
        if saved is None:
            os.environ.pop("RAY_memory_monitor_refresh_ms", None)
        else:
            os.environ["RAY_memory_monitor_refresh_ms"] = saved


def _tries(start, n: int = 3):
    for i in range(n):
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - Ray's "timed out during startup" under load: start again
            if "timed out during startup" not in str(e) or i == n - 1:
                raise


def _plan(*overrides: str):
    from rollverify.app.plan import make_plan

    return make_plan(load_config(None, ["cluster.launcher=ray", "cluster.nodes=2", "trainer.dp=2",
                                        "servers.count=2", "cluster.join_timeout_s=300", *overrides]))


def _ours() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [pg["name"] for pg in placement_group_table().values()
            if pg["name"].startswith("rollverify-") and pg["state"] != "REMOVED"]


def test_a_gpu_run_on_nodes_that_cannot_use_cuda_stops_before_anything_is_reserved(nodes):
    from rollverify.app.cluster import ClusterError, RayCluster

    plan = _plan("cluster.gpus_per_node=1", "cluster.placement=disaggregated", "cluster.rollout_gpus=1",
                 "trainer.dp=1", "servers.count=1", "rollout.max_live=4", "cluster.gpu_memory_gib=80")
    with pytest.raises(ClusterError) as info:
        RayCluster.start(plan)
    msg = str(info.value)
    assert "CUDA is not usable on 2 of the 2 GPU node(s); nothing was reserved" in msg
    assert msg.count("cannot use CUDA: torch ") == 2 and "needs NVIDIA driver 580.65.06 or newer" in msg
    assert "Fix: install NVIDIA driver 580.65.06 or newer on this node" in msg
    assert _ours() == []


def test_the_run_folder_must_be_shared_storage_and_old_checkpoints_go_on_every_node(nodes, tmp_path):
    import ray

    from rollverify.app.cluster import ClusterError, RayCluster

    _, masked = nodes
    cluster = RayCluster.start(_plan(), shared=tmp_path / "run")  # every node sees tmp_path: it starts
    try:
        assert not list((tmp_path / "run").glob(".rollverify-shared-*"))  # the marker is gone again
        labels = [next(k for k in n["Resources"] if k.startswith("rv_check_")) for n in ray.nodes()
                  if n["Alive"] and any(k.startswith("rv_check_") for k in n["Resources"])]
        assert sorted(labels) == ["rv_check_a", "rv_check_b"]
        # a checkpoint folder on every node, node B's in its own (masked) copy of the folder: pruning removes both
        old = masked / "checkpoints" / "step_000001"
        cluster.on_every_node(os.makedirs, str(old), 0o755, True)  # functions the workers can import
        cluster.on_every_node(Path.touch, old / "__0_0.distcp")
        assert cluster.on_every_node(os.path.exists, str(old)) == [True, True]
        cluster.remove_on_every_node([old])
        assert cluster.on_every_node(os.path.exists, str(old)) == [False, False]
    finally:
        cluster.close()
    with pytest.raises(ClusterError) as info:
        RayCluster.start(_plan(), shared=masked / "run")
    msg = str(info.value)
    assert f"the run folder {masked / 'run'} is not on storage every node shares" in msg
    assert msg.count("does not see") == 1 and "put --out on a file system mounted at the same path on every node" in msg
    assert _ours() == []  # refused, the placement group is released
