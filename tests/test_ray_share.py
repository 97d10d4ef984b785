"""The Ray launcher's trainer ranks receive only their data-parallel share of a batch (cut in the driver by the
rule the ranks use, `megatron_bridge.batch.share_batch`), and the routes only for calls that replay them. Two
`TrainerRank` actors (dp 2, the tiny MoE, gloo) on a local Ray; each rank reports the bytes of batch data its
last call received. The results equal those of the whole batch sent to every rank (the old way, still what a
rank does with a whole batch), and a bad sequence is refused in the driver before any rank starts."""

from __future__ import annotations

import numpy as np
import pytest
from megatron_fixtures import MARKS, fixed_sequences, hf_token_logprobs, tiny_path

pytestmark = MARKS


@pytest.fixture(scope="module")
def ranks():
    import os

    import ray

    from megatron_bridge.config import TrainerConfig
    from megatron_bridge.proxy import TrainerProxy
    from megatron_bridge.ray_trainer import RayRanks, TrainerRank

    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(max_concurrency=2)(TrainerRank)
    actors = [actor.options(num_cpus=0).remote(r, 2, None, 1) for r in range(2)]
    cfg = TrainerConfig(dp=2, lr=1e-3, micro_batch_tokens=48, replay_train=True, replay_verify=False)
    group = RayRanks(actors, ["local", "local"], tiny_path(moe=True), cfg, timeout_s=600)
    try:
        yield TrainerProxy(group), actors
    finally:
        group.close()
        ray.shutdown()


def _batch():
    path = tiny_path(moe=True)
    seqs = fixed_sequences(6, gens=(14, 9, 3, 12, 7, 4), seed=3)
    lps, routes = hf_token_logprobs(path, seqs, with_routes=True)
    for i, s in enumerate(seqs):
        s.rollout_logprobs, s.routed_experts, s.advantage = lps[i], routes[i], (1.0, -1.0, 0.5, -0.5, 0.2, -0.2)[i]
    return seqs


def _received(actors, method: str) -> list[int]:
    import ray

    return [ray.get(a.received_bytes.remote())[method] for a in actors]


def test_each_rank_receives_its_share_and_routes_only_where_replayed(ranks):
    from megatron_bridge.batch import sequence_bytes, split_for_data_parallel

    proxy, actors = ranks
    seqs = _batch()
    whole = sum(sequence_bytes(s) for s in seqs)
    route_bytes = [s.routed_experts.nbytes for s in seqs]
    shares = split_for_data_parallel([s.num_inputs for s in seqs], 2)
    want = [sum(sequence_bytes(seqs[i]) for i in share) for share in shares]

    # the old way: the whole batch, routes included, to every rank (each keeps its share)
    ref_lp, ref_ent = proxy.ranks.call("compute_logprobs", (seqs,), {"replay": True})
    assert _received(actors, "compute_logprobs") == [whole, whole]
    lp, ent = proxy.compute_logprobs(seqs, replay=True)  # replayed: routes travel, each rank its share
    assert _received(actors, "compute_logprobs") == want and sum(want) == whole
    np.testing.assert_array_equal(lp, ref_lp)
    np.testing.assert_array_equal(ent, ref_ent)
    proxy.compute_logprobs(seqs)  # verification routes freely (replay_verify=False): no routes travel
    assert _received(actors, "compute_logprobs") == [w - sum(route_bytes[i] for i in share)
                                                     for w, share in zip(want, shares, strict=True)]

    ref = proxy.ranks.call("loss_on", (seqs, ref_lp), {})
    got = proxy.loss_on(seqs, ref_lp)
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-9)
    metrics = proxy.train_step(seqs, policy_version=0)
    assert _received(actors, "train_step") == want
    assert metrics["mismatch_tokens"] == sum(s.gen_ids.size for s in seqs)  # joined over both ranks' shares
    assert metrics["mismatch_abs_max"] < 1e-3 and metrics["update_ok"] == 1.0
    print(f"bytes per rank per step: whole batch {whole} to each rank, shares {want}")


def test_a_bad_sequence_is_refused_in_the_driver(ranks):
    proxy, _ = ranks
    seqs = _batch()
    seqs[4].routed_experts = seqs[4].routed_experts[:-1]
    with pytest.raises(ValueError, match="routed experts of sequence 4 have shape"):
        proxy.train_step(seqs)
    seqs = _batch()
    seqs[2].advantage = None
    with pytest.raises(ValueError, match="sequence 2 has no advantage"):
        proxy.train_step(seqs)
