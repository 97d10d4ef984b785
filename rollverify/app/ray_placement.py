"""The Ray launcher's placement of the two wings' actors (`cluster.launcher: ray`): each trainer rank
(`megatron_bridge.ray_trainer.TrainerRank`) and each SGLang server (`sglang_ext.ray_server.ServerActor`) on the
bundle of its plan node (`RayCluster.actor_options`), with the plan's GPUs: a rank's `LOCAL_RANK` and a server's
`base_gpu_id` are the plan's physical GPU numbers (Ray leaves every GPU of a node visible, see
rollverify.app.cluster). The wings own their actor classes and what runs in them; where they go is decided here.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from megatron_bridge.config import TrainerConfig
from megatron_bridge.proxy import TrainerProxy
from megatron_bridge.ray_trainer import RayRanks, TrainerRank
from megatron_bridge.spawned import RankSetup
from rollverify.app.cluster import RayCluster
from rollverify.app.config import RunConfig
from sglang_ext.launch import ServerStartError
from sglang_ext.ray_server import RayServer, RunKeys, ServerActor, check_keys
from sglang_ext.rollout_engine import SGLangRolloutEngine


def start_ray_trainer(model_path: str | os.PathLike, cfg: TrainerConfig, cluster: RayCluster, *, dtype: str = "auto",
                      seed: int = 1234, timeout_s: float | None = None, threads_per_rank: int = 1,
                      setup: RankSetup | None = None) -> TrainerProxy:
    """`MegatronTrainer`'s methods over one `TrainerRank` actor per plan rank (rank r on plan node
    `cluster.plan.ranks[r]`, with its share of the plan's GPU there)."""
    import ray

    actor = ray.remote(max_concurrency=2)(TrainerRank)
    world = len(cluster.plan.ranks)
    actors = [actor.options(**cluster.actor_options(node, num_gpus=cluster.rank_gpus[r])).remote(
                  r, world, gpu, threads_per_rank)
              for r, (node, gpu) in enumerate(cluster.plan.ranks)]
    where = [cluster.node_name(node) for node, _ in cluster.plan.ranks]
    return TrainerProxy(RayRanks(actors, where, str(model_path), cfg, dtype=dtype, seed=seed, timeout_s=timeout_s,
                                 setup=setup))


class RayServerLauncher:
    """Starts server `i` of the plan as an actor on its plan node: `launch(i)` (also the engine's `relaunch`)."""

    def __init__(self, cfg: RunConfig, cluster: RayCluster, model_path: str | os.PathLike, log_dir: Path,
                 keys: RunKeys, startup_timeout_s: float = 1800.0, book=None) -> None:
        import ray

        self.cfg, self.cluster, self.model_path, self.log_dir = cfg, cluster, str(model_path), log_dir
        self.keys, self.startup_timeout_s, self.book = keys, startup_timeout_s, book
        self._actor = ray.remote(max_concurrency=2)(ServerActor)

    def engine_args(self, i: int) -> dict[str, Any]:
        args = self.cfg.servers.engine_args.args()
        gpus = self.cluster.plan.servers[i].gpus
        if gpus:
            args["base_gpu_id"] = gpus[0]  # a physical index: Ray leaves the node's GPUs visible
        return args

    def launch_many(self, indices: list[int]) -> list[RayServer]:
        """Start servers together (they load in parallel); if one fails, the others are stopped."""
        import ray

        node = {i: self.cluster.plan.servers[i].node for i in indices}
        actors = [self._actor.options(**self.cluster.actor_options(node[i], num_gpus=self.cluster.server_gpus[i]))
                  .remote(i) for i in indices]
        refs = [a.start.remote(self.model_path, self.engine_args(i), self.keys.for_server(),
                               str(self.log_dir / f"server{i}.log"), self.startup_timeout_s)
                for a, i in zip(actors, indices, strict=True)]
        servers, errors = [], []
        for a, i, ref in zip(actors, indices, refs, strict=True):
            where = self.cluster.node_name(node[i])
            try:
                servers.append(RayServer(i, where, a, ray.get(ref, timeout=self.startup_timeout_s + 60)))
            except Exception as e:  # noqa: BLE001 - reported together below
                errors.append(f"server {i} on {where}: {e}")
        if errors:
            for s in servers:
                s.stop()
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
            raise ServerStartError("\n".join(errors))
        if self.book is not None:
            for i in indices:
                self.book.server_started(i)
        return servers

    def launch(self, i: int) -> RayServer:
        return self.launch_many([i])[0]


def start_ray_engine(cfg: RunConfig, cluster: RayCluster, model_path: str | os.PathLike, log_dir: Path, book=None):
    """The rollout engine over `servers.count` server actors placed by `cluster`, with the run's CURVE keys;
    a server that does not serve within `servers.startup_s` is stopped. `book`: as `start_engine`'s."""
    keys = RunKeys.make()
    launcher = RayServerLauncher(cfg, cluster, model_path, log_dir, keys, cfg.servers.startup_s, book)
    servers = launcher.launch_many(list(range(len(cluster.plan.servers))))
    try:
        check_keys(servers, keys.client())
        return SGLangRolloutEngine([s.endpoint for s in servers], processes=servers, relaunch=launcher.launch,
                                   curve=keys.client(), timeout_s=cfg.servers.timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
