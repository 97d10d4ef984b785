"""Rollout routing replay (R3): route every token through the experts the engine chose for it.

SGLang reports, per response, int32 `[P + G - 1, moe_layers, top_k]`: the experts of every position whose
forward ran (all tokens but the last generated one), which is exactly the span the trainer feeds the model (see
`batch`); each position's are those of the engine's latest forward over it (a resume's re-prefill replaces the
prompt's and the kept prefix's, docs/protocol.md), so the tokens the held weights sampled replay exactly the
computation that sampled them. Megatron-Core's RouterReplay takes, per micro-batch and per MoE layer in construction order, a
`[tokens, top_k]` index tensor in Megatron's sequence-major token order (position s of row b is token
s * B + b of the [S, B] activations); the router then gathers its own probabilities at those experts (so
gradients still reach the router) instead of taking its top-k.

Any disagreement in shape, layer count, top-k or expert range is a `RoutingMismatch`, raised before the forward:
replaying a misaligned array would silently misroute every token after the first offset.

Defaults (TrainerConfig): `replay_train=True`: the old-log-prob recompute and the training forward both replay,
so the PPO ratio starts at exactly 1 and the gradient is taken through the routes that produced the tokens (the
R3 result: far smaller train/engine mismatch for MoE). `replay_verify=False`: verification must measure the new
policy as it will generate when resumed, and it will route freely; replaying the old routes would hide
exactly the drift that verification exists to catch.

Activation recompute replays too: a layer recomputed in the backward (trainer.recompute full; selective
recompute of a MoE model recomputes core attention only, which has no router) takes its routes from the
queue its forward filled (`replaying(..., for_backward=True)`), so the gradient is that of the replayed
forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from megatron_bridge.batch import MicroBatch, TrainSequence


class RoutingMismatch(ValueError):
    """A routed-experts array that does not fit its sequence or the model."""


def check_routes(seq: TrainSequence, num_layers: int, top_k: int, num_experts: int, where: str = "") -> np.ndarray:
    r = seq.routed_experts
    if r is None:
        raise RoutingMismatch(f"routing replay is on but sequence {where} has no routed experts: start the "
                              "engine with routed-expert return on, or turn replay off for this forward")
    r = np.asarray(r)
    want = (seq.num_inputs, num_layers, top_k)
    if r.shape != want:
        raise RoutingMismatch(
            f"routed experts of sequence {where} have shape {list(r.shape)}; expected {list(want)} = "
            f"[prompt {seq.prompt_ids.size} + generated {seq.gen_ids.size} - 1, moe layers, top_k]")
    if not np.issubdtype(r.dtype, np.integer):
        raise RoutingMismatch(f"routed experts of sequence {where} have dtype {r.dtype}, expected integers")
    if r.size and (r.min() < 0 or r.max() >= num_experts):
        raise RoutingMismatch(f"routed experts of sequence {where} outside [0, {num_experts}): "
                              f"min {r.min()}, max {r.max()}")
    if top_k > 1 and r.size:
        s = np.sort(r, axis=-1)
        if (s[..., 1:] == s[..., :-1]).any():
            raise RoutingMismatch(f"routed experts of sequence {where} repeat an expert within a token's top-k")
    return r


def check_all_routes(seqs: list[TrainSequence], num_layers: int, top_k: int, num_experts: int) -> None:
    """Every rank checks every sequence's routes, so a bad array fails all ranks before any collective."""
    for i, s in enumerate(seqs):
        if s is not None:  # None: another data-parallel rank's sequence (the driver checked it)
            check_routes(s, num_layers, top_k, num_experts, where=str(i))


def attach_routes(mb: MicroBatch, seqs: list[TrainSequence], num_layers: int, top_k: int,
                  num_experts: int) -> None:
    """Fill `mb.routes` (one `[S*B, top_k]` int64 tensor per MoE layer) from the sequences' engine routes."""
    b, s = mb.packed.shape
    full = np.empty((s, b, num_layers, top_k), dtype=np.int64)
    full[:] = np.arange(top_k)  # padding: any valid, distinct experts (their outputs are never used)
    for k, i in enumerate(mb.seq_index):
        r = check_routes(seqs[i], num_layers, top_k, num_experts, where=str(i))
        row, start = mb.packed.places[k]
        full[start:start + r.shape[0], row] = r
    full = full.reshape(s * b, num_layers, top_k)
    mb.routes = [torch.from_numpy(np.ascontiguousarray(full[:, layer])) for layer in range(num_layers)]


def _instances():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay.global_router_replay_instances


@contextlib.contextmanager
def replaying(routes: list[torch.Tensor] | None, layer_offset: int = 0, sp_slice: slice | None = None,
              device: torch.device | str = "cpu", for_backward: bool = False) -> Iterator[None]:
    """Within the block, MoE routers replay `routes` (None: free routing, the default top-k).

    `layer_offset` selects this pipeline stage's layers; `sp_slice` this TP rank's token slice under sequence
    parallelism. Without `for_backward` the routers are left in free routing with no data held. With it (a
    training forward whose layers are recomputed in the backward) each router keeps this forward's routes in
    Megatron-Core's backward queue (`RouterReplay.replay_backward_list`, one entry per forward, taken in order)
    and is left replaying from that queue, so the recomputed forward routes exactly as this one did; `replayed`
    around the whole forward-backward schedule clears it.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    inst = _instances()
    if routes is None or not inst:
        yield
        return
    local = routes[layer_offset:layer_offset + len(inst)]
    if len(local) != len(inst):
        raise RoutingMismatch(f"{len(routes)} routed layers for {len(inst)} MoE routers at offset {layer_offset}")
    if sp_slice is not None:
        local = [r[sp_slice] for r in local]
    RouterReplay.set_replay_data([r.to(device) for r in local])  # also queued for the backward's recompute
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    except BaseException:
        clear()
        raise
    if for_backward:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    else:
        clear()


def clear() -> None:
    """Every router back to free routing with no routes held."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()


@contextlib.contextmanager
def replayed() -> Iterator[None]:
    """Around a forward-backward schedule whose forwards replay `for_backward`: the routers end in free routing
    with nothing queued, however the schedule ends."""
    try:
        yield
    finally:
        clear()


@contextlib.contextmanager
def recording() -> Iterator[list[torch.Tensor]]:
    """Within the block, routers record their free top-k; the list is filled at exit (tests, diagnostics)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    out: list[torch.Tensor] = []
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        out.extend(t.detach().clone() for t in RouterReplay.get_recorded_data())
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
