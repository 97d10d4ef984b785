"""The Ray launcher's placement logic for the paper's GPU layouts (rollverify.app.cluster), without Ray: the bundles a
placement group reserves per node, each actor's GPU share, and the resource check that names a short node."""

from __future__ import annotations

import pytest

from rollverify.app.cluster import ClusterError, RayNode, check_resources, gpu_shares, node_needs
from rollverify.app.config import load_config
from rollverify.app.plan import check


def _plan(config: str, *overrides: str):
    return check(load_config(config, list(overrides), check_task=False))


def test_colocated_8b_reserves_every_gpu_once_and_splits_each_between_a_rank_and_a_server():
    plan = _plan("qwen3_8b_base")
    needs = node_needs(plan)
    assert [n.bundle() for n in needs] == [{"CPU": 12.0, "GPU": 8.0}] * 4  # 8 ranks + 4 servers a node
    assert [n.ranks for n in needs] == [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    assert [n.servers for n in needs] == [list(range(4 * k, 4 * k + 4)) for k in range(4)]
    ranks, servers = gpu_shares(plan)
    assert ranks == [0.5] * 32 and servers == [1.0] * 16  # a TP-2 server: half of each of its 2 GPUs
    for need in needs:  # Ray's accounting adds up to the bundle exactly
        assert sum(ranks[r] for r in need.ranks) + sum(servers[s] for s in need.servers) == need.bundle()["GPU"]


def test_disaggregated_8b_puts_the_trainer_on_nodes_0_1_and_the_servers_on_nodes_2_3():
    plan = _plan("qwen3_8b_base", "cluster.placement=disaggregated", "cluster.rollout_gpus=16", "trainer.dp=8",
                 "servers.count=8", "rollout.max_live=192")
    needs = node_needs(plan)
    assert [(len(n.ranks), len(n.servers), n.gpus) for n in needs] == [
        (8, 0, list(range(8))), (8, 0, list(range(8))), (0, 4, list(range(8))), (0, 4, list(range(8)))]
    ranks, servers = gpu_shares(plan)
    assert ranks == [1.0] * 16 and servers == [2.0] * 8  # nothing shared
    assert [s.gpus[0] for s in plan.servers] == [0, 2, 4, 6] * 2  # base_gpu_id on its node


def test_moe_30b_servers_take_four_gpus_each():
    plan = _plan("qwen3_30b_a3b_base")
    ranks, servers = gpu_shares(plan)
    assert ranks == [0.5] * 32 and servers == [2.0] * 8
    assert [n.bundle() for n in node_needs(plan)] == [{"CPU": 10.0, "GPU": 8.0}] * 4


def _nodes(*spec: tuple[float, float]) -> list[RayNode]:
    return [RayNode(f"{i:02d}" * 8, f"10.0.0.{i + 1}", gpus, cpus) for i, (gpus, cpus) in enumerate(spec)]


def test_the_resource_check_names_the_node_that_falls_short():
    needs = node_needs(_plan("qwen3_8b_base"))
    check_resources(needs, _nodes((0, 8), (8, 64), (8, 64), (8, 64), (8, 64)))  # a driver-only head is fine
    with pytest.raises(ClusterError, match=r"cluster.nodes = 4 but 3 Ray node\(s\)"):
        check_resources(needs, _nodes((8, 64), (8, 64), (8, 64)))
    with pytest.raises(ClusterError, match=r"plan node \d needs 8 GPU\(s\) and 12 CPU\(s\).*10.0.0.4 \(Ray node "
                                           r"03030303\w*\) has 4 GPU\(s\)"):
        check_resources(needs, _nodes((8, 64), (8, 64), (8, 64), (4, 64)))
    with pytest.raises(ClusterError, match=r"needs 8 GPU\(s\) and 12 CPU\(s\)"):
        check_resources(needs, _nodes((8, 64), (8, 64), (8, 64), (8, 8)))  # too few CPUs for 12 actors


# the tiny CPU run over two simulated nodes (tests/test_ray_cluster.py's layout): one rank and one server a node
TINY_TWO_NODES = ["cluster.launcher=ray", "cluster.nodes=2", "trainer.dp=2", "servers.count=2",
                  "rollout.batch_groups=2", "rollout.n=2", "rollout.max_live=8"]
SIMULATED = ((0, 0), (0, 3), (0, 3))  # what the two-node test cluster shows Ray: a driver-only head, 3 CPUs a node


def test_the_tiny_layout_is_refused_on_a_node_table_that_cannot_host_it():
    """RayCluster.start runs this check on Ray's node table before it reserves anything: a node short of GPUs
    or CPUs, or too few nodes, is named with what it has and what to do."""
    needs = lambda *o: node_needs(_plan("tiny_cpu", *TINY_TWO_NODES, *o))  # noqa: E731
    check_resources(needs(), _nodes(*SIMULATED))
    with pytest.raises(ClusterError, match=r"cluster.nodes = 3 but 2 Ray node\(s\)") as e:
        check_resources(needs("cluster.nodes=3", "trainer.dp=3", "servers.count=3"), _nodes(*SIMULATED))
    assert "tools/ray_cluster.sh worker" in str(e.value)
    with pytest.raises(ClusterError, match=r"plan node \d needs 1 GPU\(s\) and 2 CPU\(s\).*has 0 GPU\(s\)"):
        check_resources(needs("cluster.gpus_per_node=1"), _nodes(*SIMULATED))
    with pytest.raises(ClusterError, match=r"plan node \d needs 4 CPU\(s\) \(1 trainer rank\(s\), 3 server\(s\)\)"):
        check_resources(needs("servers.count=6", "rollout.max_live=12"), _nodes(*SIMULATED))
