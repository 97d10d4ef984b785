"""Collectives, host syncs and server round trips of one weight push, counted on the real code path at the paper
configs' layouts (no GPU, no model weights: the parameters are meta tensors of one rank's real shard shapes).

    python tools/push_ops.py                       # both paper configs, the transport's default bucket size
    python tools/push_ops.py --bucket-mib 1024 --json runs/push_ops.json

What runs is the trainer's own push, `megatron_bridge.weights_out.WeightsOut.send` with the application's
`TransportSpec` of the config's layout (`rollverify.app.weight_transport.TransportWeights`): the export's gathers
(`megatron_bridge.convert`), the buckets' finite checks and flattening, the sink and its sender, on trainer rank 0
(the source of server 0). Counted by instruments around it, not by a formula:

* collectives: every torch.distributed call that moves data (all_gather, all_gather_into_tensor, broadcast,
  gather_object, barrier), over a stand-in world of the config's size whose groups have the layout's sizes;
* host syncs: every tensor read back to the host (`bool`, `item`, `tolist`, `float`, `int`) during the push;
* round trips: every message to a server (the servers' control end is a counter here).

Run from another checkout (`PYTHONPATH=<that checkout> python tools/push_ops.py`) to count its code the same way:
the figures in docs/results.md were counted so before and after the push was bucketed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("configs/qwen3_8b_base.yaml", "configs/qwen3_30b_a3b_base.yaml")


class FakeGroup:
    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size

    def __repr__(self) -> str:
        return f"{self.name}[{self.size}]"


class CountingControl:
    """The servers' control end (`sglang_ext.weight_transport.ServerControl`'s methods): one round trip per
    message per server."""

    def __init__(self, spec, servers: list[int]) -> None:
        self.servers = servers
        self.counts: Counter = COUNTS

    def _trip(self, what: str) -> None:
        self.counts["round_trips"] += len(self.servers)
        self.counts[f"round_trips:{what}"] += len(self.servers)

    def begin(self, version: int) -> None:
        self._trip("begin")

    def announce(self, index: int, meta, payloads=None) -> None:
        self._trip("bucket")

    def settle(self, index: int) -> None:
        pass

    def commit(self, version: int, buckets: int) -> None:
        self._trip("commit")

    def abort(self, version: int, reason: str) -> None:
        raise AssertionError(f"push aborted: {reason}")

    def close(self) -> None:
        pass

    def control_bytes(self) -> int:
        return 0

    def join_group(self, join):
        return FakeGroup("weights", 2)


COUNTS: Counter = Counter()


@contextlib.contextmanager
def instrumented(world: int, rank: int, groups: dict[str, int]):
    """torch.distributed and Megatron-Core's group getters over a stand-in world; tensor reads counted."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    patches: list[tuple[object, str, object]] = []

    def patch(obj, name, value):
        patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def collective(kind):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            COUNTS["collectives"] += 1
            COUNTS[f"collectives:{kind}@{group.name if group is not None else 'world'}"] += 1
            if kind == "gather_object" and args[1] is not None:  # the peers' payloads, each from its own GPU
                args[1][:] = [args[0]] + [(f"peer:{i}", b"") for i in range(1, len(args[1]))]

        return call

    def group_size(group=None):
        return world if group is None else group.size

    def group_rank(group=None):
        return rank if group is None else 0

    patch(dist, "is_initialized", lambda: True)
    patch(dist, "get_world_size", group_size)
    patch(dist, "get_rank", group_rank)
    patch(dist, "get_global_rank", lambda group, r: r)
    patch(dist, "new_group", lambda ranks, **kw: FakeGroup("ipc", len(ranks)))
    for kind in ("all_gather", "all_gather_into_tensor", "broadcast", "gather_object", "barrier", "all_reduce"):
        patch(dist, kind, collective(kind))
    getters = {"get_tensor_model_parallel_group": "tp", "get_expert_model_parallel_group": "ep",
               "get_expert_tensor_parallel_group": "etp", "get_expert_tensor_and_model_parallel_group": "etp_ep",
               "get_pipeline_model_parallel_group": "pp"}
    for fn, g in getters.items():
        if hasattr(ps, fn):
            patch(ps, fn, (lambda g=g: FakeGroup(g, groups[g])))

    def reads(name, value):
        def call(self, *a, **k):
            COUNTS["host_syncs"] += 1
            COUNTS[f"host_syncs:{name}"] += 1
            return value(self)

        return call

    patch(torch.Tensor, "__bool__", reads("bool", lambda t: True))
    patch(torch.Tensor, "item", reads("item", lambda t: 0))
    patch(torch.Tensor, "tolist", reads("tolist", lambda t: [True] * t.numel()))
    patch(torch.Tensor, "__float__", reads("float", lambda t: 0.0))
    patch(torch.Tensor, "__int__", reads("int", lambda t: 0))
    try:
        yield
    finally:
        for obj, name, old in reversed(patches):
            setattr(obj, name, old)


class MetaModel(torch.nn.Module):
    """Rank `lay`'s parameters of `arch` as Megatron-Core names them, on the meta device (real shard shapes)."""

    def __init__(self, arch, lay, dtype: torch.dtype) -> None:
        super().__init__()
        from megatron_bridge import convert

        self._params = {}
        for e in convert._entries(arch):
            name = convert._local_name(e, arch, lay)
            if name is not None:
                self._params[name] = torch.nn.Parameter(
                    torch.empty(convert._shard_shape(e, arch, lay), dtype=dtype, device="meta"), requires_grad=False)

    def named_parameters(self, *a, **k):
        return iter(self._params.items())


def push_counts(config: str, bucket_bytes: int) -> dict:
    """One push of `config`'s layout from trainer rank 0, counted (module docstring)."""
    import rollverify.app.weight_transport as wt
    from megatron_bridge.convert import Layout
    from megatron_bridge.model import ModelArch
    from megatron_bridge.weights_out import WeightsOut
    from rollverify.app.config import load_config
    from rollverify.app.presets import ARCH_PRESETS
    from sglang_ext.pool import ServerAddress

    cfg = load_config(str(ROOT / config), check_task=False)
    t = cfg.trainer
    arch = ModelArch.from_hf_config(ARCH_PRESETS[cfg.model.arch])
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    etp = getattr(t, "etp", 1) or 1
    lay = Layout(tp=t.tp, tp_rank=0, ep=t.ep, ep_rank=0, pp=t.pp, pp_rank=0, etp=etp, etp_rank=0)
    server_tp = cfg.servers.engine_args.tp_size
    groups = {"tp": t.tp, "ep": t.ep, "etp": etp, "etp_ep": etp * t.ep, "pp": t.pp}
    slots = [ServerAddress(i, f"tcp://server-{i}", None) for i in range(cfg.servers.count)]
    if hasattr(wt, "spec_for"):
        spec = wt.spec_for("ipc", slots, server_tp, world, "push-ops")
    else:  # a checkout from before the bucketed push (the "before" figures)
        spec = wt.TransportWeights(None, None, "ipc", colocated=True, server_tp=server_tp,
                                   trainer_ranks=world)._spec_of(slots, "push-ops")
    out = WeightsOut(MetaModel(arch, lay, torch.bfloat16), arch, lay, ROOT)
    COUNTS.clear()
    saved = (wt.ServerControl, wt.serialize_flattened)
    wt.ServerControl, wt.serialize_flattened = CountingControl, _count_payload
    try:
        with instrumented(world, 0, groups):
            stats = out.send(spec, 1, bucket_bytes)
    finally:
        wt.ServerControl, wt.serialize_flattened = saved
    buckets = int(stats["sync_buckets"])
    return {"config": config, "world_size": world, "layout": {"tp": t.tp, "ep": t.ep, "pp": t.pp, "etp": etp},
            "server_tp": server_tp, "bucket_bytes": bucket_bytes, "buckets": buckets,
            "tensors": int(stats["sync_tensors"]), "bytes": int(stats["sync_bytes"]),
            "collectives": COUNTS["collectives"], "host_syncs": COUNTS["host_syncs"],
            "round_trips_per_server": COUNTS["round_trips"], "payloads": COUNTS["payloads"],
            "per_bucket": {k: COUNTS[k] / buckets for k in ("collectives", "host_syncs", "round_trips")},
            "detail": {k: v for k, v in sorted(COUNTS.items()) if ":" in k}}


def _count_payload(flat, meta) -> bytes:
    COUNTS["payloads"] += 1
    return b"payload"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help="a run config (default: both paper configs)")
    ap.add_argument("--bucket-mib", type=float, default=64.0, help="bucket size in MiB (the transport's default: 64)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    rows = [push_counts(c, int(a.bucket_mib * (1 << 20))) for c in (a.config or CONFIGS)]
    print(f"{'config':<34} {'buckets':>7} {'tensors':>7} {'collectives':>11} {'host syncs':>10} "
          f"{'round trips':>11} {'per bucket (coll/sync/trip)':>28}")
    for r in rows:
        pb = r["per_bucket"]
        print(f"{r['config']:<34} {r['buckets']:>7} {r['tensors']:>7} {r['collectives']:>11} {r['host_syncs']:>10} "
              f"{r['round_trips_per_server']:>11} {pb['collectives']:>10.2f} / {pb['host_syncs']:.2f} / "
              f"{pb['round_trips']:.2f}")
        print("    " + ", ".join(f"{k} {v}" for k, v in r["detail"].items()))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"written: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
