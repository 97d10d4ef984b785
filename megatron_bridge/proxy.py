"""`TrainerProxy`: `MegatronTrainer`'s methods in the driver over a `RankGroup`, the trainer's N ranks elsewhere.

The driver never imports Megatron-Core. A rank group runs each call on every rank and returns rank 0's answer; a
batch is checked here and cut into data-parallel shares, each rank receiving only its own (`batch.share_batch`);
weight streams that rank 0 produces (`sync_weights`, the HF export) reach the driver's sink while the call runs.
Two groups exist: `megatron_bridge.spawned.PipeRanks` (child processes on this machine, over pipes) and
`megatron_bridge.ray_trainer.RayRanks` (Ray actors, over actor calls); the proxy is the same over both. Any
rank's exception is raised in the driver naming the rank; a rank that dies or stalls past the group's timeout
fails the call instead of hanging it. Either way the group raises `RankFailure` (which rank, in which call, how),
and the group is broken from then on: the application closes it and starts a new one (rollverify.app.recovery).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from megatron_bridge.batch import BatchLayout, check_batch, sequences, share_batch
from megatron_bridge.policy_loss import check_rollout_logprobs
from megatron_bridge.replay import check_all_routes
from megatron_bridge.weight_sync import CallableSink, InMemorySink, WeightSink

STREAMS = ("sync_weights", "iter_hf_tensors")  # the calls whose rank 0 streams weight buckets to the sink

# the loop phase each call belongs to, as fault messages name it
PHASES = {
    "train_step": "train step (old log-probs, forward/backward, optimizer)",
    "compute_logprobs": "verification forward",
    "loss_on": "loss evaluation",
    "sync_weights": "weight push",
    "send_weights": "weight push",
    "iter_hf_tensors": "weight export",
    "export_hf_state": "weight export",
    "save_checkpoint": "checkpoint save",
    "load_checkpoint": "checkpoint load",
    "offload": "memory offload",
    "reload": "memory reload",
    "start": "start-up",
}


class RankFailure(RuntimeError):
    """A trainer rank failed a call: `kind` is "died" (its process or actor is gone), "silent" (no reply within
    the group's call timeout) or "error" (it raised; `detail` holds its traceback). `rank` is the rank that failed
    first as the driver saw it, `method` the call (`PHASES` names its phase). After any of them the group's
    collectives are in an unknown state: it is closed and replaced, never called again."""

    def __init__(self, rank: int, method: str, kind: str, detail: str = "", where: str = "") -> None:
        self.rank, self.method, self.kind, self.detail = rank, method, kind, detail
        what = {"died": "died", "silent": "gave no reply in time", "error": "failed"}[kind]
        text = f"trainer rank {rank}{f' ({where})' if where else ''} {what} in {method} ({self.phase})"
        super().__init__(text + (f":\n{detail}" if detail else ""))

    @property
    def phase(self) -> str:
        return PHASES.get(self.method, self.method)


class RankGroup(Protocol):
    """The trainer's ranks: `call` runs `method(*args, **kwargs)` on every rank (`megatron_bridge.spawned.run_call`)
    and returns rank 0's result; a call in `STREAMS` feeds rank 0's weight buckets to `sink` (begin/push/end).
    `call_each` gives rank r its own `(args, kwargs)` = `per_rank[r]` (ranks given the same object share one
    copy where the group can send one)."""

    world_size: int

    def call(self, method: str, args: tuple, kwargs: dict, sink: WeightSink | None = None) -> Any: ...

    def call_each(self, method: str, per_rank: list[tuple[tuple, dict]], sink: WeightSink | None = None) -> Any: ...

    def close(self, force: bool = False) -> None: ...


class TrainerProxy:
    """`MegatronTrainer` over a rank group (same methods, same results as rank 0's)."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self._layout: BatchLayout | None = None

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def _call(self, method: str, *args, _sink: WeightSink | None = None, **kwargs) -> Any:
        return self.ranks.call(method, args, kwargs, _sink)

    def batch_layout(self) -> BatchLayout:
        """The ranks' data-parallel layout and batch limits (`MegatronTrainer.batch_layout`), asked once."""
        if self._layout is None:
            self._layout = self._call("batch_layout")
        return self._layout

    def _by_share(self, method: str, batch, routes: bool, *rest, **kwargs) -> Any:
        """`method(share, *rest, **kwargs)` on every rank, each given only its data-parallel share of `batch`
        (`batch.share_batch`; the routes only when the call uses them), after the checks every rank would
        make, so a bad sequence fails here, before any rank starts its collectives."""
        lay = self.batch_layout()
        seqs = sequences(batch)
        check_batch(seqs, max_seq_len=lay.max_seq_len, context_length=lay.context_length,
                    vocab_size=lay.vocab_size)
        if routes:
            check_all_routes(seqs, lay.num_layers, lay.top_k, lay.num_experts)
        calls = [((share, *rest), kwargs) for share in share_batch(seqs, lay.dp, routes=routes)]
        return self.ranks.call_each(method, [calls[d] for d in lay.dp_ranks])

    def compute_logprobs(self, batch, *, replay: bool | None = None, temperature: float = 1.0):
        lay = self.batch_layout()
        routes = lay.moe and (lay.replay_verify if replay is None else replay)
        return self._by_share("compute_logprobs", batch, routes, replay=replay, temperature=temperature)

    def old_logprobs(self, batch, *, temperature: float = 1.0):
        """What `train_step` would recompute first (`MegatronTrainer.old_logprobs`), flat over the whole batch."""
        lay = self.batch_layout()
        return self._by_share("old_logprobs", batch, lay.moe and lay.replay_train, temperature=temperature)

    def train_step(self, batch, *, temperature: float = 1.0, policy_version: int | None = None,
                   old_logprobs=None) -> dict[str, float]:
        lay = self.batch_layout()
        seqs = sequences(batch)
        for i, s in enumerate(seqs):  # what train_step refuses, refused before any rank starts
            if s.advantage is None:
                raise ValueError(f"sequence {i} has no advantage")
        check_rollout_logprobs(seqs, lay.weighting)
        return self._by_share("train_step", batch, lay.moe and lay.replay_train, temperature=temperature,
                              policy_version=policy_version, old_logprobs=old_logprobs)

    def loss_on(self, batch, old_logprobs, *, temperature: float = 1.0) -> dict[str, float]:
        lay = self.batch_layout()
        return self._by_share("loss_on", batch, lay.moe and lay.replay_train, old_logprobs,
                              temperature=temperature)

    def sync_weights(self, sink, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        if not isinstance(sink, WeightSink):
            sink = CallableSink(sink)
        return self._call("sync_weights", version, bucket_bytes, dtype, _sink=sink)

    def send_weights(self, spec, version: int | None = None, bucket_bytes: int = 64 << 20,
                     dtype: torch.dtype | None = None) -> dict[str, float]:
        """The ranks stream the weights to the servers themselves (`MegatronTrainer.send_weights`)."""
        return self._call("send_weights", spec, version, bucket_bytes, dtype)

    def offload(self, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> dict[str, float]:
        """Every rank releases the device memory of `kinds` (`MegatronTrainer.offload`); rank 0's bytes."""
        return self._call("offload", tuple(kinds))

    def reload(self, kinds: tuple[str, ...] | None = None) -> dict[str, float]:
        """Every rank brings back what `offload` released (`MegatronTrainer.reload`)."""
        return self._call("reload", kinds)

    def memory_report(self) -> dict[str, int]:
        """Rank 0's GPU memory (`MegatronTrainer.memory_report`)."""
        return self._call("memory_report")

    def iter_hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Materialises the export in the driver, then yields it (the ranks stream it bucket by bucket)."""
        return iter(self.export_hf_state(dtype=dtype).items())

    def export_hf_state(self, out_dir=None, dtype: torch.dtype | None = None):
        if out_dir is not None:
            return self._call("export_hf_state", str(out_dir), dtype)
        sink = InMemorySink()
        self._call("iter_hf_tensors", _sink=sink, dtype=dtype)
        return sink.state

    def save_checkpoint(self, ckpt_dir) -> Any:
        return self._call("save_checkpoint", str(ckpt_dir))

    def load_checkpoint(self, ckpt_dir) -> None:
        return self._call("load_checkpoint", str(ckpt_dir))

    def close(self, force: bool = False) -> None:
        self.ranks.close(force)

    def __enter__(self) -> TrainerProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
