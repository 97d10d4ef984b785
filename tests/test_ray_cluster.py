"""The Ray launcher (`cluster.launcher: ray`) on a Ray cluster of two simulated nodes on this machine.

One module-scoped cluster (`ray.cluster_utils.Cluster`: a driver-only head and two nodes of 3 CPUs, each with a
custom resource naming it), stopped by the module. The run: the tiny MoE, a trainer of world size 2 (gloo) and
two SGLang servers, one rank and one server on each node, 3 steps of `rollverify` with the exact ledger; server 1's
actor is killed while it holds responses, and is restarted with the current policy and its responses resubmitted.
The refusal tests need no server: they stop in the placement, before anything starts; their messages come
from the node table (tests/test_ray_placement.py checks them without Ray), so here they are `slow` with the rest:
what they add is RayCluster.start's wait, its per-node path check and that nothing stays reserved.
"""

from __future__ import annotations

import threading

import pytest
from e2e_checks import FLOOR, REWARD
from engine_fixtures import SMALL_RUN

from rollverify.app.config import load_config

pytestmark = [pytest.mark.engine, pytest.mark.megatron]

SMALL = [
    *SMALL_RUN,
    "eval.every=0",
    "log.export_final=false",
    "cluster.launcher=ray",
    "cluster.nodes=2",
    "cluster.log_to_driver=false",
    "trainer.dp=2",
    "servers.count=2",
    "servers.timeout_s=900",
    "servers.startup_s=900",  # the shared 2-core machine can take minutes to start two servers
    "servers.engine_args.mem_fraction_static=0.3",  # SGLang's CPU pool check reads free RAM, low on a shared machine
]
NODE_CPUS = 3  # one trainer rank + one server per node, and a spare one


@pytest.fixture(scope="module")
def ray_cluster():
    import os

    import ray
    from ray.cluster_utils import Cluster

    # Ray's own memory monitor kills actors once the machine is 95 % full, which a machine shared with other
    # test runs reaches; the nodes inherit this process's environment
    saved = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for k in range(2):
            cluster.add_node(num_cpus=NODE_CPUS, resources={f"rv_node_{k}": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_memory_monitor_refresh_ms", None)
        else:
            os.environ["RAY_memory_monitor_refresh_ms"] = saved


def _label(node_id: str) -> str:
    """The custom resource that names a simulated node (all of them share this machine's address)."""
    import ray

    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    return next(k for k in node["Resources"] if k.startswith("rv_node_"))


def _key_folders() -> set[str]:
    """The servers' CURVE key folders on this machine (sglang_ext.ray_server.ServerActor.start)."""
    import glob
    import tempfile

    return set(glob.glob(f"{tempfile.gettempdir()}/rollverify-keys-server*"))


def _distributed_run(cfg, out):
    """`rollverify train`'s Run, its weights through the distributed transport (trainer rank 0 broadcasts each
    bucket over a gloo group to both servers; the disaggregated layout's transport, which a CPU config cannot
    select: the colocated one shares memory, which nodes do not)."""
    from rollverify.app.train import Run
    from rollverify.app.weight_transport import TransportWeights

    class DistributedRun(Run):
        def _weight_sync(self, engine, trainer):
            return TransportWeights(engine, trainer, "distributed", handoff=self.handoff, timeout_s=300.0)

    return DistributedRun(cfg, out)


@pytest.mark.slow
@pytest.mark.parametrize("verify_on", ["trainer", "engine"])
def test_rollverify_steps_over_two_nodes_survive_a_killed_server(ray_cluster, tmp_path, verify_on):
    """On the tiny MoE (routing replay on) with a reward that moves the weights: the trainer's ranks stay on the
    engines' log-probs across resumes and a restarted server (tests/test_replay_resume.py's check)."""
    import ray

    cfg = load_config(None, [*SMALL, "trainer.steps=3", "algo.mode=rollverify", f"algo.verify_on={verify_on}",
                             f"cluster.address={ray_cluster.address}", "model.moe=true", "model.task=null",
                             f"task.reward={REWARD}"])
    keys_before = _key_folders()
    run = _distributed_run(cfg, tmp_path)
    killed = threading.Event()
    stop = threading.Event()

    def kill_server_1_while_it_holds_responses() -> None:
        # during step 2's rollout (the policy is then at version 1): server 1's actor dies with work on it
        while not stop.wait(0.05):
            s = run.engine.pool.servers[1]
            if run.loop.step == 1 and s.alive and s.rids:
                ray.kill(s.process.actor)
                killed.set()
                return

    try:
        assert {_label(n.node_id) for n in run.cluster.nodes} == {"rv_node_0", "rv_node_1"}
        ranks = [_label(n) for n in run.trainer.ranks.nodes]
        servers = [_label(s.process.info["node_id"]) for s in run.engine.pool.servers]
        assert sorted(ranks) == sorted(servers) == ["rv_node_0", "rv_node_1"]  # one of each per node
        assert all(s.conn.endpoint.startswith("tcp://") and "127.0.0.1" not in s.conn.endpoint
                   for s in run.engine.pool.servers)  # off loopback: CURVE is on (the server refuses it otherwise)
        from sglang_ext.launch import ServerStartError
        from sglang_ext.ray_server import RunKeys, check_keys

        with pytest.raises(ServerStartError, match=r"server 0 \(plan node 0 .*the keys do not match"):
            check_keys([run.engine.pool.servers[0].process], RunKeys.make().client(), timeout_s=2)  # another run's keys
        killer = threading.Thread(target=kill_server_1_while_it_holds_responses, daemon=True)
        killer.start()
        rows = [run.loop.run_step() for _ in range(3)]  # run_step checks the ledger's invariant every step
        stop.set()
        killer.join()
        assert killed.is_set(), "server 1 never held responses during step 2"
        (fault,) = run.engine.faults
        assert fault["server"] == 1 and fault["restarted"] and fault["lost"]
        assert fault["version"] == 1
        ledger = run.loop.ledger
        assert ledger.trained == 3 * 2 * 2  # steps x B x n
        assert [r.metrics["policy_version"] for r in rows] == [1, 2, 3]
        mismatch = [r.metrics["train/mismatch_abs_max"] for r in rows if r.metrics["train/mismatch_tokens"]]
        assert mismatch and max(mismatch) < FLOOR, mismatch
        versions = [h["version"] for h in run.engine.health()]
        assert versions == [3, 3], versions  # the weights reached both servers, the restarted one included
        assert _key_folders() == keys_before  # the started servers' CURVE keys, the restarted one's too, are gone
    finally:
        stop.set()
        run.close()
    assert run.cluster is None
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def _plan(*overrides: str):
    from rollverify.app.plan import check

    return check(load_config(None, [*SMALL, *overrides]))


@pytest.mark.slow
def test_a_node_that_does_not_join_in_time_is_named(ray_cluster):
    from rollverify.app.cluster import ClusterError, RayCluster

    with pytest.raises(ClusterError, match=r"cluster.nodes = 3 but 2 Ray node\(s\)") as e:
        RayCluster.start(_plan("cluster.nodes=3", "trainer.dp=3", "servers.count=3", "cluster.join_timeout_s=1"))
    assert "tools/ray_cluster.sh worker" in str(e.value)


@pytest.mark.slow
def test_fewer_gpus_or_cpus_than_the_plan_needs_are_refused_naming_the_node(ray_cluster):
    from rollverify.app.cluster import ClusterError, RayCluster

    with pytest.raises(ClusterError, match=r"plan node \d needs 1 GPU\(s\) and 2 CPU\(s\).*has 0 GPU\(s\)"):
        RayCluster.start(_plan("cluster.gpus_per_node=1", "cluster.join_timeout_s=5"))
    with pytest.raises(ClusterError, match=r"plan node \d needs 4 CPU\(s\) \(1 trainer rank\(s\), 3 server\(s\)\)"):
        RayCluster.start(_plan("servers.count=6", "rollout.max_live=12", "cluster.join_timeout_s=5"))
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())  # nothing reserved


@pytest.mark.slow
def test_a_model_path_missing_on_the_nodes_is_named_per_node(ray_cluster, tmp_path):
    from rollverify.app.cluster import ClusterError, RayCluster

    with pytest.raises(ClusterError) as e:
        RayCluster.start(_plan("cluster.join_timeout_s=30"), [str(tmp_path / "no-model") + "/"])
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 2 and all("no-model/ does not exist on plan node" in x for x in lines)
    assert {x.split("plan node ")[1][0] for x in lines} == {"0", "1"}


@pytest.mark.slow
def test_a_killed_trainer_rank_actor_is_replaced_from_the_checkpoint(ray_cluster, tmp_path):
    """A trainer rank's actor killed mid-run on the two-node cluster: the driver sees the dead actor
    (RankFailure), kills the other rank, places new rank actors, loads the last checkpoint into them and goes on;
    each step is logged once and the ledger is exact (rollverify.app.recovery, shared with the local launcher)."""
    import json

    import ray

    from rollverify.app.recovery import Supervisor
    from rollverify.app.train import run_steps
    from rollverify.metrics import MetricsWriter, load_metrics

    cfg = load_config(None, [*SMALL, "trainer.steps=4", "algo.mode=rollverify", "log.checkpoint_every=1",
                             f"cluster.address={ray_cluster.address}"])
    run = _distributed_run(cfg, tmp_path)
    killed = threading.Event()
    stop = threading.Event()
    first = run.trainer.ranks

    def kill_rank_1_in_step_3() -> None:
        while not stop.wait(0.05):
            if run.loop.step == 2 and run.trainer.ranks is first:
                ray.kill(first._actors[1])
                killed.set()
                return

    try:
        writer = MetricsWriter(tmp_path, cfg.log)
        killer = threading.Thread(target=kill_rank_1_in_step_3, daemon=True)
        killer.start()
        run_steps(run, writer, Supervisor(run, writer, "resume"))
        stop.set()
        killer.join()
        writer.close()
        assert killed.is_set()
        (fault,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()
                    if json.loads(line)["kind"] == "trainer"]
        assert fault["rank"] == 1 and fault["how"] == "died" and fault["restored_step"] in (1, 2)  # the kill may land in the save of step 2
        assert run.trainer.ranks is not first
        assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4]
        assert run.loop.ledger.trained == 4 * 2 * 2
        assert [h["version"] for h in run.engine.health()] == [4, 4]
    finally:
        stop.set()
        run.close()


@pytest.mark.slow
def test_async_schedule_over_two_nodes_with_the_distributed_transport(ray_cluster, tmp_path):
    """algo.schedule: async, disaggregated: the Ray run's own transport (trainer rank 0 broadcasts each version
    over a gloo group to both servers) publishes while the servers generate; every trained token verified."""
    from e2e_checks import check_verified, watch_trainer

    from rollverify.app.train import Run
    from rollverify.app.weight_transport import TransportWeights

    cfg = load_config(None, [*SMALL, "trainer.steps=3", "algo.schedule=async", "algo.mode=rollverify",
                             "cluster.placement=disaggregated", f"cluster.address={ray_cluster.address}",
                             "model.moe=true", "model.task=null", f"task.reward={REWARD}"])
    run = Run(cfg, tmp_path)
    try:
        assert isinstance(run.loop.weights, TransportWeights) and run.loop.weights.kind == "distributed"
        steps = watch_trainer(run)
        rows = [run.loop.run_step().metrics for _ in range(3)]  # run_step checks the ledger every step
        assert [r["policy_version"] for r in rows] == [1, 2, 3]
        assert run.loop.ledger.trained == 3 * 2 * 2
        assert [h["version"] for h in run.engine.health()] == [3, 3]
        check_verified(steps, cfg)
    finally:
        run.close()
