"""The GPU-time simulation: its cost model, its event engine, and sanity checks of the real loop over it.

The loop and strategies are the project's own; only the engine's and trainer's time is simulated. The
small settings here (a few servers, tens of responses) keep each run well under a second.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rollverify.app.cli import main as cli
from rollverify.interfaces import SamplingParams
from rollverify.sim.cost import ClusterSpec, CostModel, ModelSpec
from rollverify.sim.engine import DriftModel, SimClock, SimEngine, SimTrainer, Workload
from rollverify.sim.run import SimConfig, compare, simulate
from rollverify.sim.servers import _units_within
from rollverify.types import Group

SMALL = SimConfig(
    cluster=ClusterSpec(gpus=4),
    workload=Workload(median_tokens=1500.0, token_unit=64),
    batch_groups=8,
    n=4,
    steps=6,
)


def test_decode_is_memory_bound_at_small_batch_and_compute_bound_at_large():
    cost = CostModel(ModelSpec(), ClusterSpec())
    one, sixty_four = cost.decode_iteration(4, 4 * 1000), cost.decode_iteration(64, 64 * 1000)
    assert sixty_four < 1.7 * one  # weights dominate: 16x the sequences for well under 2x the time
    huge = cost.decode_iteration(4096, 0)  # matmul FLOPs dominate
    assert cost.decode_iteration(8192, 0) == pytest.approx(2 * huge - ClusterSpec().decode_overhead_s, rel=1e-9)
    assert cost.decode_iteration(1, 60_000) > 1.3 * cost.decode_iteration(1, 0)  # long contexts read their KV


def test_h200_decodes_faster_than_h800_and_tp_splits_the_weights():
    m = ModelSpec()
    h800, h200 = CostModel(m, ClusterSpec(gpu="H800")), CostModel(m, ClusterSpec(gpu="H200"))
    assert h200.decode_iteration(8, 8000) < h800.decode_iteration(8, 8000)
    tp2 = CostModel(m, ClusterSpec(tp=2))
    assert tp2.cluster.servers == 16 and tp2.decode_iteration(8, 8000) < h800.decode_iteration(8, 8000)
    with pytest.raises(ValueError, match="cluster.gpu"):
        ClusterSpec(gpu="A100")


def test_units_within_matches_brute_force():
    rng = np.random.default_rng(0)
    alpha, beta = rng.uniform(0.01, 1, 50), rng.uniform(0, 0.01, 50)
    seconds = rng.uniform(0, 100, 50)
    k = _units_within(alpha, beta, seconds)
    for a, b, s, got in zip(alpha, beta, seconds, k, strict=True):
        cum = np.cumsum(a + b * np.arange(10_000))
        assert got == int(np.searchsorted(cum, s, side="right"))


def test_deterministic_for_a_seed_and_different_for_another():
    a, b = simulate("rollverify", 8192, SMALL), simulate("rollverify", 8192, SMALL)
    assert a == b
    c = simulate("rollverify", 8192, replace(SMALL, seed=1))
    assert c.step_s_mean != a.step_s_mean


def test_without_a_long_tail_carry_over_gains_nothing():
    flat = replace(SMALL, workload=replace(SMALL.workload, sigma_prompt=0.0, sigma_response=0.0))
    results = {8192: {m: simulate(m, 8192, flat) for m in ("on_policy", "partial", "rollverify")}}
    row = compare(results)[0]
    assert row["partial_ratio"] == pytest.approx(1.0, abs=0.03)
    assert row["rollverify_ratio"] == pytest.approx(1.0, abs=0.03)


def test_with_a_long_tail_carry_over_gains_and_verification_costs_some_of_it():
    tail = replace(SMALL, workload=replace(SMALL.workload, sigma_response=1.2), drift=DriftModel(sigma=0.006, growth=0.0))
    results = {16384: {m: simulate(m, 16384, tail) for m in ("on_policy", "partial", "rollverify")}}
    row = compare(results)[0]
    assert row["partial_ratio"] < 0.8
    assert row["partial_ratio"] < row["rollverify_ratio"] < 1.0
    rv = results[16384]["rollverify"]
    assert 0 < rv.acceptance_mean < 1 and rv.cut_fraction > 0 and rv.phase_s["verify"] > 0
    assert "verify" not in results[16384]["partial"].phase_s  # partial runs no verification forward


def test_engine_side_verification_prefills_instead_of_a_trainer_forward():
    tail = replace(SMALL, workload=replace(SMALL.workload, sigma_response=1.2), drift=DriftModel(sigma=0.006, growth=0.0))
    on_trainer = simulate("rollverify", 16384, tail)
    on_engine = simulate("rollverify", 16384, replace(tail, algo=replace(tail.algo, verify_on="engine")))
    assert on_trainer.verify_on == "trainer" and on_engine.verify_on == "engine"
    assert on_trainer.phase_s["verify"] > 0 and "verify_prefill" not in on_trainer.phase_s
    assert "verify" not in on_engine.phase_s and "verify_prefill" not in on_engine.phase_s  # no forward, no stop
    assert 0 < on_engine.acceptance_mean < 1 and on_engine.cut_fraction > 0  # the real verification cuts from it
    assert on_engine.verify_share == 0 < on_trainer.verify_share


def test_engine_logprobs_are_the_trainers_and_the_resumed_prefix_reuses_their_prefill():
    cost, workload, drift = CostModel(ModelSpec(), ClusterSpec(gpus=2)), Workload(token_unit=64), DriftModel(sigma=0.05)
    clock = SimClock()
    engine = SimEngine(cost, workload, clock, drift=drift, total_steps=4)
    trainer = SimTrainer(cost, drift, SimClock(), workload.token_unit, total_steps=4)
    responses = Group.new(0, np.zeros(256, np.int32), 4, workload.max_units).responses
    engine.submit(responses, SamplingParams())
    engine._step(limit=5.0)  # every response is still running
    for chunk in engine.pause():
        r = next(r for r in responses if r.response_id == chunk.response_id)
        r.append(chunk.token_ids, chunk.logprobs, chunk.versions)
    assert all(r.num_tokens > 2 for r in responses)
    engine.update_weights(iter([]), 1)
    trainer.version = 1
    prefill_before, now = engine.prefill_s, clock.now
    new = engine.compute_logprobs(responses)
    for got, want in zip(new, trainer.compute_logprobs(responses, 1.0), strict=True):
        np.testing.assert_array_equal(got, want)
    total = sum(cost.prefill(256 + r.num_tokens * workload.token_unit) for r in responses)
    assert engine.verify_prefill_s == pytest.approx(total) == -engine.credit.sum()  # owed by the servers
    assert total / 2 * (1 - 1e-9) <= -engine.credit.min() < total and clock.now == now  # in parallel, no stop
    engine.truncate({responses[0].response_id: responses[0].num_tokens // 2})
    engine.resume()  # the kept prefixes are in the servers' KV cache: nothing prefills again
    assert engine.prefill_s == prefill_before
    engine.pause()
    engine.update_weights(iter([]), 2)
    engine.resume()  # stale KV: everything prefills under the new weights
    assert engine.prefill_s > prefill_before


def test_on_policy_time_is_set_by_the_longest_response_of_each_batch():
    tail = replace(SMALL, workload=replace(SMALL.workload, sigma_response=1.5))
    r = simulate("on_policy", 32768, tail)
    # the rollout can never beat decoding its longest response alone, and with a heavy tail it barely does more
    assert 1.0 <= r.on_policy_longest_share < 1.35


def test_no_drift_keeps_everything_and_strong_drift_switches_to_on_policy():
    calm = replace(SMALL, drift=DriftModel(sigma=0.0, spike_rate=0.0))
    r = simulate("rollverify", 16384, replace(calm, workload=replace(SMALL.workload, sigma_response=1.2)))
    assert r.acceptance_mean == 1.0 and r.cut_fraction == 0.0 and r.switched_at is None
    wild = replace(SMALL, drift=DriftModel(sigma=0.2, growth=0.0), steps=8, algo=replace(SMALL.algo, switch_window=2))
    r = simulate("rollverify", 16384, replace(wild, workload=replace(SMALL.workload, sigma_response=1.2)))
    assert r.acceptance_mean < 0.5 and r.switched_at is not None and r.switched_at <= 4


def test_cli_refuses_bad_input_before_simulating(capsys, tmp_path):
    assert cli(["simulate", "--steps", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--steps" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert cli(["simulate", "--contexts", "100", "--out", str(tmp_path / "y")]) == 2
    assert "context" in capsys.readouterr().err and not (tmp_path / "y").exists()
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "simulate.json").write_text("mine")
    assert cli(["simulate", "--out", str(tmp_path / "z")]) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "z" / "simulate.json").read_text() == "mine"


def test_paper_comparison_reports_the_error_against_table_7():
    fake = {32768: {"on_policy": replace(simulate("on_policy", 8192, SMALL), gpu_days=100.0),
                    "rollverify": replace(simulate("on_policy", 8192, SMALL), gpu_days=50.0)}}
    row = compare(fake)[0]
    assert row["paper_ratio"] == pytest.approx(57.5 / 98.1)
    assert row["ratio_error"] == pytest.approx(0.5 / (57.5 / 98.1) - 1)
    assert row["within_15pct"] is True and math.isclose(row["rollverify_ratio"], 0.5)


def test_an_idle_server_pays_off_the_prefill_it_owes_as_time_passes():
    """compute_logprobs' prefill is server time owed: a server with nothing running pays it off as the clock
    moves (the other server's decode moves it), rather than having it forgiven or stopping the clock."""
    cost, workload, drift = CostModel(ModelSpec(), ClusterSpec(gpus=2)), Workload(token_unit=64), DriftModel(sigma=0.05)
    clock = SimClock()
    engine = SimEngine(cost, workload, clock, drift=drift, total_steps=4)
    assert engine.servers.n == 2
    responses = Group.new(0, np.zeros(256, np.int32), 3, workload.max_units).responses
    engine.submit(responses, SamplingParams())
    engine._step(limit=5.0)
    for chunk in engine.pause():
        next(r for r in responses if r.response_id == chunk.response_id).append(
            chunk.token_ids, chunk.logprobs, chunk.versions)
    engine.update_weights(iter([]), 1)
    runs, held = responses[0], responses[1:]
    engine.resume(hold=[r.response_id for r in held])  # one response runs, on server 0
    assert engine.servers.srv[engine.tracked[runs.response_id].slot] == 0
    engine.compute_logprobs(held)  # one prefill owed by each server
    owed = -engine.credit.copy()
    assert owed[1] > 0 and not engine.servers.running(1).size
    now = clock.now
    engine._step(limit=owed[1] / 4)
    assert clock.now - now == pytest.approx(owed[1] / 4)
    assert -engine.credit[1] == pytest.approx(owed[1] * 3 / 4)  # paid off in part while idle, not forgiven
    engine.release([r.response_id for r in held])
    assert engine.credit[1] == pytest.approx(-owed[1] * 3 / 4)  # their prefixes are cached: nothing more to prefill


def test_tool_waits_lengthen_on_policy_steps_and_carry_over_saves_more_of_them():
    """Multi-turn: trajectories make up to 6 calls of ~20 s; on_policy waits for the longest trajectory's turns
    and calls, the carry-over modes do not (a call in flight goes on through training)."""
    from rollverify.sim.engine import ToolModel

    base = replace(SMALL, workload=replace(SMALL.workload, sigma_response=0.3), drift=DriftModel(sigma=0.002, growth=0.0))
    tools = replace(base, tools=ToolModel(max_calls=6, latency_median_s=20.0, latency_sigma=1.0))
    plain = {m: simulate(m, 8192, base) for m in ("on_policy", "partial", "rollverify")}
    multi = {m: simulate(m, 8192, tools) for m in ("on_policy", "partial", "rollverify")}
    assert plain["on_policy"].tool_calls_per_step == 0 and multi["on_policy"].tool_calls_per_step > 0
    assert multi["on_policy"].step_s_mean > plain["on_policy"].step_s_mean + 20.0  # it waits for calls
    assert multi["on_policy"].tool_idle_share > 0  # at times every live sequence waits on a call
    saved_plain = plain["partial"].step_s_mean / plain["on_policy"].step_s_mean
    saved_multi = multi["partial"].step_s_mean / multi["on_policy"].step_s_mean
    assert saved_multi < saved_plain and saved_multi < 0.8
    rv = multi["rollverify"]
    assert rv.step_s_mean < multi["on_policy"].step_s_mean and 0 < rv.acceptance_mean <= 1
    assert simulate("partial", 8192, tools) == multi["partial"]  # deterministic


def test_a_cut_before_a_call_cancels_it_and_a_pause_lets_it_run_on():
    from rollverify.sim.engine import ToolModel

    cost, workload = CostModel(ModelSpec(), ClusterSpec(gpus=2)), Workload(token_unit=64)
    clock = SimClock()
    engine = SimEngine(cost, workload, clock, tools=ToolModel(max_calls=3, alpha=0.0, latency_median_s=50.0,
                                                              latency_sigma=0.0))
    g = Group.new(0, np.zeros(256, np.int32), 4, workload.max_units)
    engine.submit(g.responses, SamplingParams())
    calls = {r.response_id: engine.tracked[r.response_id].calls for r in g.responses}
    assert any(calls.values())
    while not any(t.wake is not None for t in engine.tracked.values()):
        engine._step()
    waiting = next(rid for rid, t in engine.tracked.items() if t.wake is not None)
    at = engine.tracked[waiting].length
    chunks = {c.response_id: c for c in engine.pause()}
    assert len(chunks[waiting].token_ids) == at  # its turn up to the call is reported at the pause
    wake = engine.tracked[waiting].wake
    clock.advance(10.0, "train")  # the call runs on through training
    engine.truncate({waiting: at - 1})  # a cut before the call: cancelled, made again when reached
    assert engine.tracked[waiting].wake is None
    engine.resume()
    assert engine.tracked[waiting].slot >= 0 and wake > clock.now


def test_the_tool_model_is_learnt_from_a_runs_metrics(tmp_path):
    from rollverify.sim.engine import ToolModel

    truth = ToolModel(max_calls=7, alpha=1.2, latency_median_s=0.05, latency_sigma=0.8)
    rng = np.random.default_rng(0)
    c = np.arange(8)
    w = (c + 1.0) ** -1.2
    rows = []
    for step in range(20):  # what a run's tool turns log per step (rollverify/tool_turns.py step_stats)
        secs = 0.05 * np.exp(0.8 * rng.standard_normal(400))
        turns = rng.choice(c, size=64, p=w / w.sum())
        rows.append({"step": step + 1, "tools/tool_s_p50": float(np.median(secs)),
                     "tools/tool_s_p99": float(np.percentile(secs, 99)), "tools/turns_mean": float(turns.mean()),
                     "tools/turns_max": float(turns.max())})
    got = ToolModel.fit(rows)
    assert got.max_calls == 7
    assert got.latency_median_s == pytest.approx(truth.latency_median_s, rel=0.1)
    assert got.latency_sigma == pytest.approx(truth.latency_sigma, rel=0.15)
    assert got.alpha == pytest.approx(truth.alpha, abs=0.25)
    with pytest.raises(ValueError, match="no tool metrics"):
        ToolModel.fit([{"step": 1, "reward_mean": 0.5}])
    (tmp_path / "run").mkdir()
    assert cli(["simulate", "--out", str(tmp_path / "o"), "--tools-from", str(tmp_path / "run")]) == 2


def test_the_async_schedule_runs_disaggregated_and_every_split_is_tried():
    from rollverify.sim.async_run import simulate_async
    from rollverify.sim.run import simulate_split, splits

    assert splits(SimConfig()) == list(range(1, 32))  # 22 / 10 included, not a grid of four
    assert splits(replace(SMALL, cluster=ClusterSpec(gpus=8, tp=2))) == [2, 4, 6]
    tail = replace(SMALL, workload=replace(SMALL.workload, sigma_response=1.2), drift=DriftModel(sigma=0.006, growth=0.0))
    on = simulate("on_policy", 16384, tail)
    runs = {m: simulate_split(m, 16384, tail, log=lambda *_: None) for m in ("async_rollverify", "async_partial")}
    for mode, r in runs.items():
        assert r.rollout_gpus + r.trainer_gpus == 4 and set(r.split_search) == {"1", "2", "3"}
        assert r.gpu_days == pytest.approx(min(r.split_search.values()))
        assert 0 < r.trainer_busy_share <= 1 and r.trained_staleness_max <= tail.algo.max_staleness
        assert r.gpu_days < on.gpu_days  # the long tail no longer holds the step up
        for g in r.split_pruned:  # a split stopped early could not have won: run to the end, it costs more
            full = simulate_async(mode, 16384, tail, int(g))
            assert full is not None and full["gpu_days"] >= r.split_search[g] >= r.gpu_days * (1 - 1e-12)
    assert any(r.split_pruned for r in runs.values())  # the bound does stop some
    rv, partial = runs["async_rollverify"], runs["async_partial"]
    assert partial.cut_fraction == 0 and rv.cut_fraction > 0 and rv.returned_groups > 0
    assert 0 < rv.acceptance_mean < 1


def test_cli_refuses_a_split_that_leaves_a_side_without_gpus(capsys, tmp_path):
    assert cli(["simulate", "--modes", "async_rollverify", "--rollout-gpus", "32", "--out", str(tmp_path / "x")]) == 2
    assert "--rollout-gpus" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_servers_kv_pool_is_what_sglang_computes():
    """SGLang 0.5.23 on an 80 GB H800 (81,559 MiB), tp 1, no mem_fraction_static given: it reserves 512 + 8192 x 1.5
    (chunked prefill) + 128 (tp / 8 GiB) + 256 x 2 (decode graphs) + 58 x 8 (prefill graphs) = 13,904 MiB and keeps
    round(1 - 13904 / 81559, 3) = 0.83; the pool is (free before loading) x 0.83 - weights, over 147,456 B a token."""
    from rollverify.sim.cost import sglang_mem_fraction_static

    assert sglang_mem_fraction_static(81559, 1) == 0.83 and sglang_mem_fraction_static(143771, 1) == 0.903
    cost = CostModel(ModelSpec(), ClusterSpec(resident_gib=3.0))
    pre = 81559 * 2**20 - 3 * 2**30
    assert cost.kv_capacity_tokens() == int((pre * 0.83 - 8.19e9 * 2) // (36 * 8 * 128 * 2 * 2))  # ~352K tokens
    assert ModelSpec().kv_bytes_per_token_per_gpu(2) * 2 == ModelSpec().kv_bytes_per_token  # tp 2 splits the heads
    assert ModelSpec(kv_heads=1).kv_bytes_per_token_per_gpu(4) == ModelSpec(kv_heads=1).kv_bytes_per_token
    assert CostModel(ModelSpec(), ClusterSpec(max_total_tokens=1000)).kv_capacity_tokens() == 1000
    assert CostModel(ModelSpec(), ClusterSpec(mem_fraction_static=0.5)).kv_capacity_tokens() < cost.kv_capacity_tokens()
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        CostModel(ModelSpec(params=40e9), ClusterSpec()).kv_capacity_tokens()


def _drain(engine: SimEngine, check) -> dict[str, int]:
    """Run the engine until every response finished; `check()` after each event; the units each one reported."""
    got: dict[str, int] = {}
    while engine._live():
        for chunk in engine.wait_finished(1.0):
            got[chunk.response_id] = got.get(chunk.response_id, 0) + len(chunk.token_ids)
        check()
    return got


def test_a_server_over_its_kv_room_queues_and_retracts_and_the_cost_shows():
    """One server whose pool holds ~2.5 responses at the context limit: requests beyond its room wait, the running
    ones outgrow it and are retracted (the fewest outputs first) and prefilled again; nothing is lost, the pool is
    never over-full, and the run takes longer than on an unlimited server."""
    cost, workload = CostModel(ModelSpec(), ClusterSpec(gpus=1)), Workload(context=8192, median_tokens=8000.0,
                                                                           token_unit=16)
    responses = {}

    def run(capacity: float) -> tuple[SimEngine, dict[str, int]]:
        clock = SimClock()
        engine = SimEngine(cost, workload, clock, capacity=capacity)
        groups = [Group.new(g, np.zeros(256, np.int32), 8, workload.max_units) for g in range(2)]
        for g in groups:
            engine.submit(g.responses, SamplingParams())
            responses.update({r.response_id: r for r in g.responses})
        s = engine.servers
        if math.isfinite(capacity):
            assert s.waiting() > 0 and s.nrun[0] < 16  # admission stops where SGLang's reserve runs out

        def check() -> None:
            on = s.running(0)
            assert s.used[0] == pytest.approx(float(s.ctx[on].sum()))
            assert s.used[0] <= capacity

        return engine, _drain(engine, check)

    tight, got = run(20_000.0)
    free, got_free = run(math.inf)
    s = tight.servers
    assert s.retractions > 0 and s.retracted_tokens > 0 and s.retract_prefill_s > 0
    assert s.prefill_s > free.servers.prefill_s + s.retract_prefill_s * 0.99  # the second prefills are paid
    assert s.queued_request_s > 0 and free.servers.retractions == 0 and free.servers.queued_request_s == 0
    assert tight.clock.now > free.clock.now  # fewer sequences share each iteration, and the re-prefills cost
    assert got == got_free == {rid: t.target for rid, t in tight.tracked.items()}  # every response whole
    assert 0.9 < s.kv_peak <= 1.0


def test_retraction_takes_the_fewest_outputs_first_and_resets_the_estimate():
    cost, workload = CostModel(ModelSpec(), ClusterSpec(gpus=1)), Workload(context=8192, token_unit=16)
    engine = SimEngine(cost, workload, SimClock(), capacity=9_000.0)
    group = Group.new(0, np.zeros(256, np.int32), 3, workload.max_units)
    engine.submit(group.responses, SamplingParams())
    s = engine.servers
    s.ratio[0] = 0.0  # let all three in
    s.fill(0)
    for i, r in enumerate(group.responses):  # three running sequences of 256 + 16 x (10, 100, 200) tokens
        slot = engine.tracked[r.response_id].slot
        s.ctx[slot] = s.base_ctx[slot] + 16 * (10, 100, 200)[i]
        s.rem[slot] = 400
    s.used[0] = float(s.ctx[s.running(0)].sum())
    s.capacity = s.used[0] + 16 * 3 - 1  # the next unit of three sequences no longer fits
    s.retract(engine.tracked)
    assert s.retractions == 1 and s.nrun[0] == 2
    assert engine.tracked[group.responses[0].response_id].retracted  # the one with the fewest outputs
    assert s.queues[0][0][0] == group.responses[0].response_id
    left = s.running(0)
    want = ((s.ctx[left] - s.base_ctx[left]).sum() + 20 * 2) / ((s.limit[left] - s.base_ctx[left]).sum() + 1)
    assert s.ratio[0] == pytest.approx(want)


def test_training_counts_causal_attention_flops_as_computed_by_hand():
    model = ModelSpec(params=1e9, layers=2, q_heads=4, kv_heads=2, head_dim=8)
    assert model.attn_flops_per_pair == 4 * 2 * 4 * 8  # QK^T and PV, 2 FLOPs per multiply-add, every layer and head
    lengths = np.array([3.0, 5.0])
    fwd = 2e9 * 8 + 256 * (3 * 4 / 2 + 5 * 6 / 2)  # linear + causal pairs L (L + 1) / 2 of each sequence
    assert model.forward_flops(lengths) == pytest.approx(fwd)
    cluster = ClusterSpec(gpus=4, mfu_train=0.5)
    cost = CostModel(model, cluster)
    per_s = 989e12 * 0.5 * 4
    assert cost.forward(lengths) == pytest.approx(fwd / per_s)
    assert cost.train(lengths) == pytest.approx(3 * fwd / per_s)  # forward + backward (twice the forward)
    # Qwen3-8B, one 32K sequence: attention is 59 % of the linear FLOPs (2 x 8.19e9 x 32768)
    q = ModelSpec()
    assert q.forward_flops(32768.0) == pytest.approx(2 * 8.19e9 * 32768 + 589_824 * 32768 * 32769 / 2)
    # the trainer pays the old-log-prob forward in a step given none, not in one given them
    clock = SimClock()
    trainer = SimTrainer(cost, DriftModel(), clock, unit=1, total_steps=4)
    rs = [Group.new(0, np.zeros(1, np.int32), 2, 8).responses[i] for i in range(2)]
    for r, n in zip(rs, (2, 4), strict=True):
        r.append(np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int64))
    trainer.train_step(rs, np.zeros(2), 1.0, 0)
    assert clock.spent["old_logprob"] == pytest.approx(fwd / per_s)
    assert clock.spent["train"] == pytest.approx(3 * fwd / per_s)
    trainer.train_step(rs, np.zeros(2), 1.0, 1, old_logprobs=[np.zeros(2), np.zeros(4)])
    assert clock.spent["old_logprob"] == pytest.approx(fwd / per_s) and clock.spent["train"] == pytest.approx(6 * fwd / per_s)
    assert trainer.drift_clock.shares == [0.0, 1.0]  # the second step trained version-0 tokens at version 1


def test_the_floor_is_the_workloads_reads_and_flops_by_hand_and_below_every_mode():
    from rollverify.sim.cost import GPUS
    from rollverify.sim.floor import FloorSpec, physical_floor
    from rollverify.sim.run import run_all

    model, gpu, workload = ModelSpec(), GPUS["H800"], Workload(prompt_tokens=100)
    lengths = np.array([1000.0, 3000.0])
    got = physical_floor(model, gpu, 32, workload, lengths, steps=1, paper_steps=500, spec=FloorSpec(0.5, 0.25, 64))
    kv = sum(147_456 * (100 * L + L * (L - 1) / 2) for L in lengths)  # each token reads its context's KV
    weights = 8.19e9 * 2 / 64 * 4000  # and a 64th of the weights
    decode = (kv + weights) / (3.35e12 * 0.5)
    train = 4 * model.forward_flops(100 + lengths) / (989e12 * 0.25)  # old-log-prob forward + forward + backward
    assert got["decode_gpu_s_per_step"] == pytest.approx(decode)
    assert got["train_gpu_s_per_step"] == pytest.approx(train)
    assert got["step_s"] == pytest.approx((decode + train) / 32)
    assert got["gpu_days"] == pytest.approx((decode + train) * 500 / 86400)
    report = run_all(SMALL, [8192], ("on_policy", "partial"), log=lambda *_: None, sensitivity_runs=False)
    row = report["comparison"][0]
    for spec in SMALL.floors:
        assert 0 < row[f"{spec.name}_ratio"] < row["partial_ratio"] <= 1.0  # no mode beats the floor
    assert report["floors"]["8192"][0]["generated_tokens_per_step"] == pytest.approx(
        report["results"][8192]["on_policy"].tokens_per_step, rel=0.02)  # the same workload as on_policy's


def test_every_headline_ratio_is_shown_under_the_drift_range_and_the_conclusions_follow():
    from rollverify.sim.run import run_all

    cfg = replace(SMALL, workload=replace(SMALL.workload, sigma_response=1.2))
    report = run_all(cfg, [16384], ("on_policy", "partial", "rollverify"), log=lambda *_: None)
    sens = report["sensitivity"]["16384"]
    assert list(sens) == ["progress late 0.85", "progress late 0.8", "progress late 0.9", "progress late 0.95",
                          "offpolicy late 0.85"]
    partial = {row["partial_ratio"] for row in sens.values()}
    assert len(partial) == 1  # partial computes no new log-prob: the drift cannot move it
    rv = [sens[f"progress late {x}"]["rollverify_ratio"] for x in ("0.8", "0.85", "0.9", "0.95")]
    assert rv[0] > rv[-1]  # an earlier collapse costs more
    claims = {c["claim"]: c for c in report["conclusions"]}
    c = claims["rollverify costs less than on_policy"]
    assert set(c["holds_under"]) | set(c["fails_under"]) == set(sens)
    assert c["verdict"] == ("survives the range" if not c["fails_under"] else "depends on the drift"
                            if c["holds_under"] else "fails under every drift")
    assert "async_rollverify costs less than on_policy" not in claims  # no async run: not judged
    assert report["drift_per_version"]["ops_one_version"]["0.85"] > report["drift_per_version"]["ops_one_version"]["0.5"]


def test_offpolicy_drift_grows_with_the_off_policy_tokens_trained():
    from rollverify.sim.engine import DriftClock

    progress = DriftClock(DriftModel(), steps=10)
    assert progress.x(4) == pytest.approx(0.4)
    off = DriftClock(DriftModel(driver="offpolicy", offpolicy_ref=0.5), steps=10)
    for share in (0.0, 0.5, 1.0):
        off.record(share)
    assert off.x(1) == 0.0 and off.x(3) == pytest.approx(1.5 / (10 * 0.5))
    with pytest.raises(ValueError, match="drift.driver"):
        DriftModel(driver="time")
    cfg = replace(SMALL, drift=DriftModel(driver="offpolicy"))
    on, partial = simulate("on_policy", 8192, cfg), simulate("partial", 8192, cfg)
    assert on.offpolicy_share == 0.0 < partial.offpolicy_share < 1.0


def test_every_input_is_labelled_measured_or_guessed():
    from rollverify.sim.inputs import inputs
    from rollverify.sim.run import _config_dict

    rows = {r["key"]: r for r in inputs(_config_dict(SimConfig()))}
    assert not [k for k, r in rows.items() if r["kind"] == "unlabelled"]
    for key in ("cluster.bw_eff", "cluster.mfu_train", "cluster.sync_overhead_s", "drift.late", "drift.sigma",
                "workload.median_tokens", "cluster.resident_gib", "floors.floor_bw75_mfu40.mfu"):
        assert rows[key]["guessed"], key
    for key in ("gpu_spec.peak_flops", "model.kv_heads", "cluster.mem_fraction_static", "sglang.clip_max_new_tokens",
                "batch_groups", "algo.d_s"):
        assert not rows[key]["guessed"], key


def test_tail_batching_in_the_model_trains_nothing_off_policy_and_drops_the_deferred_work():
    tail = replace(SMALL, workload=replace(SMALL.workload, sigma_response=1.2), steps=8)
    on, tb = (simulate(m, 16384, tail) for m in ("on_policy", "on_policy_tb"))
    assert tb.long_rounds >= 1 and on.long_rounds == 0
    assert tb.offpolicy_share == 0.0 and on.offpolicy_share == 0.0  # every trained token is its step's policy's
    assert tb.cut_fraction > 0 and on.cut_fraction == 0  # the deferred groups' partial responses were dropped
    assert tb.tokens_per_step > on.tokens_per_step
