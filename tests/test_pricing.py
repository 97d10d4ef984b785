"""The priced cost: its arithmetic, a run's figures from its records, and the loop's count of prefilled tokens."""

from __future__ import annotations

import math

import pytest
from fakes import make_loop

from rollverify.pricing import FIELDS, PRICES, Prices, priced_iterations, run_cost
from rollverify.sim.cost import ClusterSpec, CostModel, ModelSpec


def test_prices_follow_the_gpu_time_model():
    # Qwen3-8B on an H800 at the model's defaults: one decode iteration of one sequence is the weights' read plus
    # the overhead (~8.5 ms); a token's matmuls take ~33 us in decode and ~37 us in prefill
    assert PRICES.decode_tokens_per_iter == pytest.approx(257.2, abs=0.5)
    assert PRICES.prefill_tokens_per_iter == pytest.approx(231.5, abs=0.5)
    # a GPU with twice the bandwidth reads the weights in half the time: fewer tokens fill one iteration
    fast = Prices.of(CostModel(ModelSpec(), ClusterSpec(gpu="H200")))
    assert fast.decode_tokens_per_iter < PRICES.decode_tokens_per_iter


def test_priced_iterations_add_tokens_and_prefill_to_the_iterations():
    p = Prices(decode_tokens_per_iter=200.0, prefill_tokens_per_iter=100.0)
    assert priced_iterations(10, 0, 0, p) == 10
    assert priced_iterations(10, 400, 300, p) == 10 + 2 + 3


def test_run_cost_from_step_records_and_the_ledger():
    p = Prices(200.0, 100.0)
    records = [{"step": 1, "decode_iters": 10, "tokens_generated": 400, "prefill_tokens": 300},
               {"step": 2, "decode_iters": 20, "tokens_generated": 0, "prefill_tokens": 100}]
    cost = run_cost(records, {"generated_tokens": 400, "trained_tokens": 200}, p)
    assert cost["priced"] == pytest.approx((15 + 21) / 2)
    assert cost["priced_se"] == pytest.approx(3.0)  # stdev of 15 and 21 over sqrt(2)
    assert cost["decode_iters"] == 15 and cost["prefill_tokens"] == 200 and cost["generated_per_trained"] == 2
    # a step from before prefill was counted leaves the priced figure unknown, not understated
    old = [{"step": 1, "decode_iters": 10, "tokens_generated": 400}]
    assert run_cost(old)["priced"] is None and run_cost(old)["decode_iters"] == 10
    assert run_cost([])["priced"] is None and run_cost([])["generated_per_trained"] is None


def test_the_loop_counts_every_prompt_and_resumed_prefix_it_prefills():
    for mode in ("on_policy", "partial", "rollverify"):
        loop, engine, _ = make_loop(mode, drift=0.01, conditional_switch=False)
        for _ in range(5):
            # what the phase resumes: every unfinished response the engine holds, prompt and prefix re-prefilled
            resumed = sum(3 + r.num_tokens for r in loop.buffer.pending() if r.response_id in engine.tracked)
            m = loop.run_step().metrics
            launched = m["n_launched_groups"] * loop.cfg.n  # prompts of 3 tokens each
            assert set(FIELDS) <= set(m)
            assert m["prefill_tokens"] == resumed + 3 * launched, mode
            if mode == "on_policy":
                assert resumed == 0
        if mode != "on_policy":
            assert resumed > 0, mode  # the carry-over modes resumed something
    assert math.isfinite(run_cost([m])["priced"])
