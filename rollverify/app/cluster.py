"""The Ray launcher's placement: one placement group that reserves, node by node, what `rollverify plan` placed.

`cluster.launcher: ray` runs trainer ranks and SGLang servers as Ray actors (megatron_bridge.ray_trainer,
sglang_ext.ray_server). Before any of them starts, `RayCluster.start`:

1. connects to the Ray cluster (`cluster.address`; null: RAY_ADDRESS, else a Ray instance started here for a
   one-node run) and waits up to `cluster.join_timeout_s` for `cluster.nodes` nodes;
2. checks that enough nodes have what one plan node needs (its GPUs, one CPU per actor) and names every node
   that falls short;
3. on a GPU run, checks on every node with GPUs that this node's torch can use CUDA (`rollverify.devices`): a
   node whose driver is too old for torch's CUDA build is named with its driver, the one needed and the fix,
   before anything is reserved;
4. reserves one bundle per plan node (`STRICT_SPREAD`: plan node k is the Ray node that holds bundle k) and
   waits for the placement group;
5. checks on every node that the files the run reads (model folder, data files) are there, and that the run
   folder (`--out`) is storage every node shares: the driver writes a marker there that every node must read
   back (a trainer rank reads the checkpoint's description rank 0 wrote, every rank writes and reads its
   shards there, a resume reads them from any node).

Every failure is a `ClusterError` naming the plan node and its Ray node (address and id: simulated nodes on one
machine share the address). Actors then go to plan node k with `RayCluster.actor_options(k, ...)`: pinned to
bundle k, with their share of each GPU they use counted against it, and the run's environment
(`rollverify.devices.run_env`: the device the config chose, so a trainer rank or server never falls back to the
CPU, and `cluster.socket_ifname` for gloo's and NCCL's sockets). Ray does not narrow `CUDA_VISIBLE_DEVICES`
(`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`, as slime does), so every process of a node sees all its GPUs and
the plan's GPU numbers are physical: a trainer rank's `LOCAL_RANK` and a server's `base_gpu_id` are the plan's.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollverify.app.config import ConfigError, RunConfig
from rollverify.devices import device_report, run_env

if TYPE_CHECKING:
    from rollverify.app.plan import Plan

NOSET_CUDA = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


class ClusterError(RuntimeError):
    """The Ray cluster cannot run the plan (missing node, too few GPUs/CPUs, a file missing on a node)."""


@dataclass(frozen=True)
class NodeNeed:
    """What plan node `index` needs from its Ray node: the plan's GPUs on it and one CPU per actor."""

    index: int
    ranks: list[int]
    servers: list[int]
    gpus: list[int]  # local GPU ids used on the node (empty on CPU)

    @property
    def cpus(self) -> int:
        return len(self.ranks) + len(self.servers)

    def bundle(self) -> dict[str, float]:
        out: dict[str, float] = {"CPU": float(self.cpus)}
        if self.gpus:
            out["GPU"] = float(len(self.gpus))
        return out

    def describe(self) -> str:
        what = [f"{len(self.ranks)} trainer rank(s)", f"{len(self.servers)} server(s)"]
        gpus = f"{len(self.gpus)} GPU(s) and " if self.gpus else ""
        return f"plan node {self.index} needs {gpus}{self.cpus} CPU(s) ({', '.join(what)})"


def node_needs(plan: Plan) -> list[NodeNeed]:
    """Per plan node: its ranks, servers and GPUs (from `plan.ranks` and `plan.servers`)."""
    needs = []
    for k in range(plan.cfg.cluster.nodes):
        ranks = [r for r, (n, _) in enumerate(plan.ranks) if n == k]
        servers = [s.index for s in plan.servers if s.node == k]
        gpus = sorted({g for r in ranks if (g := plan.ranks[r][1]) is not None}
                      | {g for s in plan.servers if s.node == k for g in s.gpus})
        needs.append(NodeNeed(k, ranks, servers, gpus))
    return needs


def gpu_shares(plan: Plan) -> tuple[list[float], list[float]]:
    """Ray's GPU count for each trainer rank and each server: a GPU used by m actors counts 1/m for each (the
    sum over a node is its bundle's GPUs; colocated actors share)."""
    users: dict[tuple[int, int], int] = {}
    for n, g in plan.ranks:
        if g is not None:
            users[(n, g)] = users.get((n, g), 0) + 1
    for s in plan.servers:
        for g in s.gpus:
            users[(s.node, g)] = users.get((s.node, g), 0) + 1
    share = lambda n, gs: math.floor(sum(1 / users[(n, g)] for g in gs) * 1e4) / 1e4  # noqa: E731
    ranks = [share(n, [] if g is None else [g]) for n, g in plan.ranks]
    return ranks, [share(s.node, s.gpus) for s in plan.servers]


@dataclass(frozen=True)
class RayNode:
    """A Ray node as the placement found it."""

    node_id: str
    ip: str
    gpus: float
    cpus: float

    def name(self) -> str:
        return f"{self.ip} (Ray node {self.node_id[:12]})"


def alive_nodes() -> list[RayNode]:
    import ray

    return [RayNode(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("GPU", 0.0),
                    n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n["Alive"]]


def _describe_nodes(nodes: list[RayNode]) -> str:
    return "; ".join(f"{n.name()}: {n.gpus:g} GPU, {n.cpus:g} CPU" for n in nodes) or "none"


def check_resources(needs: list[NodeNeed], nodes: list[RayNode]) -> None:
    """Enough nodes can each host one plan node (GPUs, CPUs); otherwise name the nodes that fall short."""
    usable = [n for n in nodes if n.cpus > 0 or n.gpus > 0]  # a driver-only head holds nothing
    if len(usable) < len(needs):
        raise ClusterError(
            f"cluster.nodes = {len(needs)} but {len(usable)} Ray node(s) with CPUs or GPUs are up "
            f"({_describe_nodes(nodes)}): start the missing workers (tools/ray_cluster.sh worker HEAD_ADDRESS) or "
            "lower cluster.nodes")
    for need in sorted(needs, key=lambda x: (-len(x.gpus), -x.cpus)):
        fits = [n for n in usable if n.gpus >= len(need.gpus) and n.cpus >= need.cpus]
        if not fits:
            short = ", ".join(
                f"{n.name()} has {n.gpus:g} GPU(s) and {n.cpus:g} CPU(s)" for n in usable)
            raise ClusterError(f"no Ray node can host plan node {need.index}: {need.describe()}; {short}. Lower "
                               "cluster.gpus_per_node / servers.count / trainer.dp, or start nodes with more "
                               "resources (ray start --num-gpus/--num-cpus)")
        usable.remove(max(fits, key=lambda n: (n.gpus, n.cpus)))


def check_devices(reports: dict[RayNode, dict]) -> None:
    """Every GPU node's `device_report` says CUDA works; else a ClusterError naming each node that cannot."""
    bad = [f"{n.name()}: {r['problem']}" for n, r in reports.items() if r.get("problem")]
    if bad:
        raise ClusterError(f"CUDA is not usable on {len(bad)} of the {len(reports)} GPU node(s); nothing was "
                           "reserved:\n  " + "\n  ".join(bad))


def _shared_report(marker: str, token: str) -> str:
    """On a node: '' when `marker` holds `token`, else what this node sees there instead."""
    path = Path(marker)
    try:
        got = path.read_text()
    except FileNotFoundError:
        parent = "exists" if path.parent.is_dir() else "does not exist"
        return f"does not see {path} (its folder {path.parent} {parent} there)"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    return "" if got == token else f"reads another file at {path} (a folder of the same name, not the same storage)"


def _remove(paths: list[str]) -> list[str]:
    """On a node: remove each path (a folder or file), returning those still there."""
    left = []
    for p in paths:
        path = Path(p)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if path.exists() or path.is_symlink():
            left.append(p)
    return left


def _path_report(paths: list[str]) -> dict[str, str]:
    """On a node: what is wrong with each path the run reads ('' when fine)."""
    out = {}
    for p in paths:
        path = Path(p).expanduser()
        if p.endswith("/"):  # a model folder: config.json and safetensors
            if not path.is_dir():
                out[p] = "does not exist" if not path.exists() else "is not a folder"
            elif not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
                out[p] = "has no config.json or no *.safetensors"
        elif not path.is_file():
            out[p] = "does not exist"
    return out


class RayCluster:
    """A connection to Ray plus the run's placement group (one bundle per plan node); `close` releases both."""

    def __init__(self, plan: Plan, pg: Any, nodes: list[RayNode], started_ray: bool) -> None:
        self.plan = plan
        self.pg = pg
        self.nodes = nodes  # plan node k -> the Ray node holding bundle k
        self.needs = node_needs(plan)
        self.rank_gpus, self.server_gpus = gpu_shares(plan)
        self.env = {**NOSET_CUDA, **run_env(plan.cfg.cluster.gpus_per_node, plan.cfg.cluster.socket_ifname)}
        self._started_ray = started_ray

    @classmethod
    def start(cls, plan: Plan, paths: list[str] = (), shared: str | os.PathLike | None = None) -> RayCluster:
        """Connect, wait for the nodes, check a GPU run's CUDA on every GPU node, reserve the placement group,
        check `paths` on every node (a path ending in '/' is a model folder) and that `shared` (the run folder)
        is the same storage on every node. Raises ClusterError naming the node that falls short."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        c = plan.cfg.cluster
        started = False
        if not ray.is_initialized():
            address = c.address or os.environ.get("RAY_ADDRESS")
            if address is None and c.nodes > 1:
                raise ConfigError("cluster.address: a run over several nodes joins a running Ray cluster; start one "
                                  "(tools/ray_cluster.sh head) and set cluster.address=auto or HEAD_IP:6379")
            # a Ray started here (one node) counts a CPU per actor whatever the machine has: actors mostly wait
            own = {} if address else {"num_cpus": max(os.cpu_count() or 1, sum(n.cpus for n in node_needs(plan)))}
            env = {**NOSET_CUDA, **run_env(c.gpus_per_node, c.socket_ifname)}
            ray.init(address=address or "local", log_to_driver=c.log_to_driver, include_dashboard=False,
                     runtime_env={"env_vars": env}, **own)  # "local": never another one found here
            started = True
        try:
            needs = node_needs(plan)
            deadline = time.monotonic() + c.join_timeout_s
            while len([n for n in alive_nodes() if n.cpus or n.gpus]) < c.nodes and time.monotonic() < deadline:
                time.sleep(0.5)
            check_resources(needs, alive_nodes())
            if c.gpus_per_node:
                check_devices(_on_nodes([n for n in alive_nodes() if n.gpus > 0], device_report,
                                        timeout_s=max(1.0, deadline - time.monotonic())))
            pg = placement_group([n.bundle() for n in needs], strategy="STRICT_SPREAD" if c.nodes > 1 else "PACK",
                                 name=f"rollverify-{os.getpid()}")
            if not pg.wait(timeout_seconds=max(1, int(deadline - time.monotonic()))):
                remove_placement_group(pg)
                raise ClusterError(
                    f"the placement group ({', '.join(f'node {n.index}: {n.bundle()}' for n in needs)}) was not "
                    f"placed within cluster.join_timeout_s = {c.join_timeout_s:g} s; Ray nodes: "
                    f"{_describe_nodes(alive_nodes())}")
            by_id = {n.node_id: n for n in alive_nodes()}
            where = placement_group_table(pg)["bundles_to_node_id"]
            self = cls(plan, pg, [by_id[where[k]] for k in range(len(needs))], started)
        except BaseException:
            if started:
                ray.shutdown()
            raise
        try:
            self.check_paths(list(paths))
            if shared is not None:
                self.check_shared(shared)
        except BaseException:
            self.close()
            raise
        return self

    def actor_options(self, node: int, *, num_gpus: float = 0.0, num_cpus: float = 1.0,
                      env: dict[str, str] | None = None) -> dict[str, Any]:
        """`.options(...)` for an actor on plan node `node`: pinned to its bundle, Ray leaving the GPUs visible,
        with the run's environment (`self.env`: its device, its sockets' interface)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=node),
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            runtime_env={"env_vars": {**self.env, **(env or {})}},
        )

    def on_every_node(self, fn, *args: Any) -> list[Any]:
        """`fn(*args)` once on every plan node (a task pinned to its bundle); the results by plan node."""
        import ray

        task = ray.remote(fn)
        refs = [task.options(**self.actor_options(k, num_cpus=0)).remote(*args) for k in range(len(self.nodes))]
        return ray.get(refs, timeout=self.plan.cfg.cluster.join_timeout_s)

    def check_shared(self, folder: str | os.PathLike) -> None:
        """`folder` (the run folder) is storage every plan node shares: a marker the driver writes there is read
        back on every node; else a ClusterError naming each node that does not see it, and the fix."""
        folder = Path(folder).expanduser().absolute()
        folder.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        marker = folder / f".rollverify-shared-{token[:12]}"
        marker.write_text(token)
        try:
            reports = self.on_every_node(_shared_report, str(marker), token)
        finally:
            marker.unlink(missing_ok=True)
        bad = [f"{self.node_name(k)} {why}" for k, why in enumerate(reports) if why]
        if bad:
            raise ClusterError(
                f"the run folder {folder} is not on storage every node shares:\n  " + "\n  ".join(bad) + "\n"
                "Every trainer rank writes its checkpoint shards there and reads the checkpoint's description and "
                "everyone's shards when it resumes: put --out on a file system mounted at the same path on every "
                "node (NFS, Lustre, GPFS, a cloud file store); see docs/cluster.md, 'Shared storage'")

    def remove_on_every_node(self, paths: list[str | os.PathLike]) -> None:
        """Remove `paths` (old checkpoint folders) on every plan node, so that no node keeps shards of them, even
        one whose writes did not reach the shared storage; a ClusterError names what a node could not remove."""
        paths = [str(p) for p in paths]
        if not paths:
            return
        left = [f"{p} on {self.node_name(k)}" for k, got in enumerate(self.on_every_node(_remove, paths))
                for p in got]
        if left:
            raise ClusterError("old checkpoint folders could not be removed: " + "; ".join(left))

    def node_name(self, node: int) -> str:
        return f"plan node {node} at {self.nodes[node].name()}"

    def check_paths(self, paths: list[str]) -> None:
        """Every path exists on every plan node; else a ClusterError listing what is missing where."""
        if not paths:
            return
        import ray

        task = ray.remote(_path_report)
        refs = [task.options(**self.actor_options(k, num_cpus=0)).remote(paths) for k in range(len(self.nodes))]
        problems = []
        for k, report in enumerate(ray.get(refs, timeout=self.plan.cfg.cluster.join_timeout_s)):
            problems += [f"{p} {why} on {self.node_name(k)}" for p, why in report.items()]
        if problems:
            raise ClusterError("files the run reads are missing on its nodes (every node needs the model and the "
                               "data at the same path):\n  " + "\n  ".join(problems))

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            try:
                remove_placement_group(self.pg)
            finally:
                if self._started_ray:
                    ray.shutdown()


def files_read(cfg: RunConfig, model_path: str | os.PathLike) -> list[str]:
    """What every node must find at the same path: the model folder (ends in '/') and the data files named in
    `task.options` (`*path` keys) and `eval.sets`."""
    paths = [str(Path(model_path).expanduser()) + "/"]
    paths += [v for k, v in cfg.task.options.items() if k.endswith("path") and isinstance(v, str)]
    for spec in cfg.eval.sets.values():
        path = spec.get("path") if isinstance(spec, dict) else spec
        if isinstance(path, str):
            paths.append(path)
    return paths


def _on_nodes(nodes: list[RayNode], fn, *args: Any, timeout_s: float) -> dict[RayNode, Any]:
    """`fn(*args)` on each of `nodes` (a task pinned to the node, no CPU reserved), before any placement group."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(fn)
    refs = {n: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False), num_cpus=0,
                            runtime_env={"env_vars": dict(NOSET_CUDA)}).remote(*args) for n in nodes}
    return {n: ray.get(ref, timeout=timeout_s) for n, ref in refs.items()}
