"""The asynchronous schedule's logic (rollverify/async_loop.py) over the simulator's engine and trainer.

`SimEngine` and `SimTrainer` implement the loop's protocols on a simulated clock, with drifting log-probs
(`DriftModel`); `SimCalls` runs the trainer's calls on the trainer's own clock while the engines keep generating.
So these tests run the real `AsyncLoop`, `RolloutBuffer`, strategies and verification over many steps in well
under a second each; tests/test_async_e2e.py runs the same loop on a real SGLang server and Megatron-Core trainer.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from rollverify.async_loop import AsyncLoop
from rollverify.buffer import RolloutBuffer
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.sim.async_run import SimCalls
from rollverify.sim.cost import ClusterSpec, CostModel, ModelSpec
from rollverify.sim.engine import DriftModel, SimClock, SimEngine, SimTrainer, Workload
from rollverify.strategies import AlgoConfig
from rollverify.types import Group
from rollverify.verify import two_stage_verify

WORKLOAD = Workload(context=4096, prompt_tokens=64, median_tokens=800, token_unit=16)


class Recorded(SimTrainer):
    """The simulated trainer, keeping what each step trained: its responses (copies), the version it held and
    the old log-probs it was handed, and what it would have computed itself."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict] = []

    def train_step(self, responses, advantages, temperature, policy_version, old_logprobs=None):
        own = [self.drift.new_logprobs(self.seed, r, self.version, self.version / self.total_steps, self.unit)
               for r in responses]
        self.steps.append({
            "version": self.version, "policy_version": policy_version, "old": old_logprobs, "own": own,
            "tokens": [(r.logprobs.copy(), r.versions.copy()) for r in responses],
            "ids": [r.response_id for r in responses],
        })
        return super().train_step(responses, advantages, temperature, policy_version, old_logprobs)


class LosingEngine(SimEngine):
    """A server that loses the responses `lose` names (what it generated since their last report is gone)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lost: list[str] = []

    def lose(self, rids) -> None:
        for rid in rids:
            t = self.tracked.pop(rid)
            if t.slot >= 0:
                self._release(t)
            self._lost.append(rid)

    def lost(self):
        out, self._lost = self._lost, []
        return out

    def response_ids(self):
        return set(self.tracked).union(self._lost)


def make(algo: AlgoConfig | None = None, *, sigma: float = 0.02, steps: int = 10, engine_cls=SimEngine,
         batch_groups: int = 4, max_live: int = 32):
    clock, drift = SimClock(), DriftModel(sigma=sigma)
    engine = engine_cls(CostModel(ModelSpec(), ClusterSpec(gpus=4)), WORKLOAD, clock, 0, drift=drift,
                        total_steps=steps)
    trainer = Recorded(CostModel(ModelSpec(), ClusterSpec(gpus=2)), drift, clock, WORKLOAD.token_unit, steps, 0)
    cfg = RolloutConfig(batch_groups=batch_groups, n=4, max_new_tokens=WORKLOAD.max_units, max_live=max_live,
                        wait_s=0.0)
    algo = algo or AlgoConfig(schedule="async")
    prompt = np.zeros(WORKLOAD.prompt_tokens, np.int32)
    loop = AsyncLoop(algo, Rollout(cfg, engine, trainer, lambda g: Group.new(g, prompt, cfg.n, WORKLOAD.max_units),
                                   lambda g, r: float(r.index % 2)), calls=SimCalls(clock, engine, trainer))
    return loop, engine, trainer


def assert_every_trained_token_verified(trainer: Recorded, algo: AlgoConfig) -> None:
    """Each step trained from the version it verified against, with the old log-probs of that version, and
    every token passes both stages against them and lies within the staleness bound."""
    for s in trainer.steps:
        assert s["policy_version"] == s["version"]
        for (lp, ver), old, own in zip(s["tokens"], s["old"], s["own"], strict=True):
            np.testing.assert_array_equal(old, own)
            assert s["version"] - ver.min() <= algo.max_staleness
            result = two_stage_verify(old, lp, ver, np.array([len(lp)]), algo.d_s, algo.d_t)
            assert int(result.keep_lengths[0]) == len(lp)


def test_the_trainer_runs_while_the_engines_generate_and_every_trained_token_is_verified():
    algo = AlgoConfig(schedule="async", conditional_switch=False)
    loop, engine, trainer = make(algo, sigma=0.3)
    rows = [loop.run_step().metrics for _ in range(10)]  # run_step checks the ledger after every step
    assert [r["policy_version"] for r in rows] == list(range(1, 11))
    assert loop.ledger.trained == 10 * 4 * 4
    # the engines generated while the trainer worked: tokens were recorded under every version
    versions = np.concatenate([v for s in trainer.steps for _, v in s["tokens"]])
    assert set(np.unique(versions)) >= set(range(8))
    assert max(r["trained_staleness_max"] for r in rows) >= 1  # trained responses span versions
    assert sum(r["n_returned_groups"] for r in rows) > 0, "the drift must make verification send groups back"
    assert loop.ledger.cut_tokens > 0
    assert_every_trained_token_verified(trainer, algo)
    assert engine.clock.spent.get("idle", 0.0) < engine.clock.now  # the servers did not wait out the trainer
    assert not engine.paused
    loop.close()
    assert engine.paused and not engine.response_ids()  # nothing generates or stays held for a run that ended


def test_a_returned_group_s_cut_responses_regenerate_their_suffixes_under_the_newest_version():
    algo = AlgoConfig(schedule="async", conditional_switch=False)
    loop, engine, trainer = make(algo, sigma=0.3)
    cuts: dict[str, tuple[int, int]] = {}  # response id -> (kept tokens, the version when it was sent back)
    original = loop._return

    def watch(group, keep):
        cuts.update({rid: (k, loop.version) for rid, k in keep.items()
                     if k < group.responses[int(rid.split("-")[1])].num_tokens})
        original(group, keep)

    loop._return = watch
    for _ in range(10):
        loop.run_step()
    trained = {rid: ver for s in trainer.steps for rid, (_, ver) in zip(s["ids"], s["tokens"], strict=True)}
    later = [rid for rid in cuts if rid in trained]
    assert later, "no cut response was trained later"
    for rid in later:
        keep, version = cuts[rid]
        assert (trained[rid][keep:] >= version).all()  # its suffix came from the version it was cut under, or newer
    assert_every_trained_token_verified(trainer, algo)


def test_partial_is_the_unverified_baseline_bounded_only_by_staleness():
    algo = AlgoConfig(schedule="async", mode="partial", max_staleness=1)
    loop, _, trainer = make(algo, sigma=0.3)
    rows = [loop.run_step().metrics for _ in range(8)]
    assert all(r["n_returned_groups"] == 0 or r["verify/restarted_stale"] > 0 for r in rows)
    assert max(r["trained_staleness_max"] for r in rows) <= 1
    assert all(r["acceptance_rate"] == 1.0 for r in rows if r["verify/restarted_stale"] == 0)
    # unverified: some trained token fails the two stages against its step's policy
    fails = 0
    for s in trainer.steps:
        for (lp, ver), old in zip(s["tokens"], s["old"], strict=True):
            fails += int(two_stage_verify(old, lp, ver, np.array([len(lp)]), 0.01, 2.0).keep_lengths[0] < len(lp))
    assert fails


def test_the_staleness_bound_restarts_in_flight_responses_at_the_publish():
    algo = AlgoConfig(schedule="async", mode="partial", max_staleness=0)
    loop, engine, trainer = make(algo)
    rows = [loop.run_step().metrics for _ in range(6)]
    assert sum(r["n_restarted_stale"] for r in rows) > 0
    assert all(r["trained_staleness_max"] == 0 for r in rows)
    for r in loop.buffer.carried_over():
        assert r.staleness(loop.version) == 0


def test_engine_side_verification_cuts_in_flight_responses_at_each_update():
    algo = AlgoConfig(schedule="async", verify_on="engine", conditional_switch=False)
    loop, engine, trainer = make(algo, sigma=0.3)
    rows = [loop.run_step().metrics for _ in range(8)]
    assert sum(r.get("engine_verify/responses", 0) for r in rows) > 0
    assert sum(r.get("engine_verify/cut_tokens", 0) for r in rows) > 0
    assert engine.verify_prefill_s > 0
    assert_every_trained_token_verified(trainer, algo)


@pytest.mark.parametrize("fallback", ["alternating", "on_policy"])
def test_low_acceptance_falls_back_with_the_ledger_intact(fallback):
    # d_s = 0: every segment fails, so acceptance is 0 once responses span versions
    algo = AlgoConfig(schedule="async", d_s=0.0, switch_window=1, fallback=fallback)
    loop, engine, trainer = make(algo)
    rows = [loop.run_step().metrics for _ in range(6)]
    switched = [r["step"] for r in rows if r.get("switched")]
    assert switched, [(r["step"], r.get("acceptance_rate")) for r in rows]
    first = switched[0]
    assert rows[first - 1]["fallback"] == ("on_policy" if fallback == "on_policy" else "rollverify")
    later = rows[first:]
    assert later and all(r["schedule"] == "alternating" for r in later)
    if fallback == "on_policy":
        assert all(r["mode"] == "on_policy" for r in later)
    assert [r["policy_version"] for r in rows] == list(range(1, 7))
    assert loop.ledger is loop.fallback.ledger and loop.ledger.trained == 6 * 4 * 4
    keys = [sorted(r) for r in rows]  # one record shape for the run, before the switch, at it and after
    assert all(k == keys[0] for k in keys), [sorted(set(k) ^ set(keys[0])) for k in keys]
    loop.ledger.check(loop.buffer)


def test_a_lost_server_s_responses_are_regenerated_and_nothing_is_lost_or_duplicated():
    algo = AlgoConfig(schedule="async", conditional_switch=False)
    loop, engine, trainer = make(algo, sigma=0.3, engine_cls=LosingEngine)
    loop.run_step()
    polls = {"n": 0}
    wait = engine.wait_finished

    def lose_some(timeout):
        polls["n"] += 1
        if polls["n"] in (3, 9):  # mid-step, while a trainer call runs
            live = sorted(rid for rid, t in engine.tracked.items() if t.slot >= 0)
            engine.lose(live[::2])
        return wait(timeout)

    engine.wait_finished = lose_some
    rows = [loop.run_step().metrics for _ in range(5)]  # the ledger is checked after every step
    assert sum(r["n_resubmitted"] for r in rows) > 0
    assert loop.ledger.trained == 6 * 4 * 4
    held = set(engine.tracked)
    for r in loop.buffer.pending():  # every unfinished buffer response is on the engine, once
        assert r.response_id in held
    assert_every_trained_token_verified(trainer, algo)


def test_a_checkpoint_with_a_full_queue_resumes_on_fresh_engines(tmp_path):
    algo = AlgoConfig(schedule="async", conditional_switch=False, queue_groups=8)
    loop, engine, trainer = make(algo, sigma=0.3)
    for _ in range(3):
        loop.run_step()
    loop.await_finished(8)  # the queue fills while the trainer would be busy elsewhere
    queued = list(loop.buffer.completed)
    assert len(queued) >= 8 and loop.buffer.pending()
    loop.buffer.save(tmp_path / "buffer.npz")
    (tmp_path / "loop.json").write_text(json.dumps(loop.state()))
    in_flight = {r.response_id: r.num_tokens for r in loop.buffer.pending()}

    fresh, engine2, trainer2 = make(algo, sigma=0.3)
    trainer2.version = loop.version  # the trainer's checkpoint
    fresh.restore(json.loads((tmp_path / "loop.json").read_text()), RolloutBuffer.load(tmp_path / "buffer.npz"))
    assert fresh.buffer.completed == queued and fresh.version == loop.version == 3
    assert {r.response_id: r.num_tokens for r in fresh.buffer.pending()} == in_flight
    m = fresh.run_step().metrics
    assert m["queue_groups_at_start"] == len(queued)
    assert fresh.step == 4 and fresh.ledger.trained == loop.ledger.trained + 16
    # the step verified the queue's first groups first: each was trained or sent back cut
    first = {int(rid.split("-")[0]) for rid in trainer2.steps[0]["ids"]}
    assert first <= set(queued) and m["verify/responses"] >= 16
    fresh.ledger.check(fresh.buffer)


def test_async_config_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="algo.mode 'on_policy' has no meaning in algo.schedule: async"):
        AlgoConfig(schedule="async", mode="on_policy")
    with pytest.raises(ValueError, match="algo.schedule must be one of"):
        AlgoConfig(schedule="fast")
    with pytest.raises(ValueError, match="AsyncLoop runs algo.schedule: async"):
        make(AlgoConfig())
    replace(AlgoConfig(schedule="async"), mode="partial")


@pytest.mark.parametrize(("overrides", "message"), [
    (["algo.schedule=async"], r"cluster\.placement is colocated: set cluster\.placement=disaggregated"),
    (["algo.schedule=async", "cluster.placement=disaggregated", "cluster.gpus_per_node=1"],
     r"needs the servers and the trainer on separate GPUs, but the cluster has one"),
    (["algo.schedule=async", "cluster.placement=disaggregated", "cluster.gpus_per_node=2"],
     r"cluster\.rollout_gpus: disaggregated needs GPUs for both sides"),
    (["algo.schedule=async", "cluster.placement=disaggregated", "algo.mode=staleness_filter"],
     r"algo\.mode 'staleness_filter' has no meaning in algo\.schedule: async"),
    (["algo.schedule=async", "cluster.placement=disaggregated", "algo.queue_groups=2", "rollout.batch_groups=4"],
     r"algo\.queue_groups: 2 finished groups would never fill a step"),
])
def test_train_refuses_an_async_run_that_cannot_work_before_anything_starts(tmp_path, capsys, overrides, message):
    from rollverify.app.cli import main as cli_main

    rc = cli_main(["train", "--config", "tiny_cpu", "--out", str(tmp_path / "x"), *overrides])
    assert rc == 2
    assert __import__("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "x").exists()


def test_one_gpu_is_refused_for_the_async_schedule():
    from rollverify.app.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"the cluster has one"):
        load_config(None, ["algo.schedule=async", "cluster.placement=colocated", "cluster.gpus_per_node=1"])


def test_the_cpu_plan_accepts_the_async_schedule_disaggregated():
    from rollverify.app.config import load_config
    from rollverify.app.plan import check

    check(load_config(None, ["algo.schedule=async", "cluster.placement=disaggregated"]))


@pytest.mark.parametrize("mode", ["partial", "rollverify"])
@pytest.mark.parametrize("verify_on", ["trainer", "engine"])
def test_every_step_record_holds_the_same_keys_whatever_the_step_held(mode, verify_on):
    """rollverify.metrics' rule: what a step had nothing to measure for (no round returned a group, nothing in
    flight to verify at the publish, no stale response) is present, a count 0 or a null figure."""
    algo = AlgoConfig(schedule="async", mode=mode, verify_on=verify_on, conditional_switch=False, max_staleness=2)
    loop, _, _ = make(algo, sigma=0.3)
    rows = [loop.run_step().metrics for _ in range(8)]
    keys = [sorted(r) for r in rows]
    assert all(k == keys[0] for k in keys), [sorted(set(k) ^ set(keys[0])) for k in keys]
    # the run had steps with and without what the conditional figures measure
    assert len({r["n_returned_groups"] > 0 for r in rows}) == 2 or mode == "partial"


def test_the_switch_sees_one_acceptance_per_step_whatever_rounds_it_took():
    # a drift that sends groups back, so steps take several rounds; a wide window never fires
    algo = AlgoConfig(schedule="async", switch_window=100)
    loop, engine, trainer = make(algo, sigma=0.3)
    rows = [loop.run_step().metrics for _ in range(8)]
    assert max(r["verify_rounds"] for r in rows) > 1, "the drift must make some step verify more than once"
    assert loop.switch.updates == sum(1 for r in rows if r["verified_tokens"] > 0)
    assert sum(r["n_returned_groups"] for r in rows) >= sum(r["n_returned_again"] for r in rows) >= 0


def test_a_tail_batched_fallback_trains_only_the_steps_own_tokens_after_its_first_step():
    algo = AlgoConfig(schedule="async", d_s=0.0, switch_window=1, tail_batching=True)
    loop, engine, trainer = make(algo, max_live=24)
    rows = [loop.run_step().metrics for _ in range(6)]
    first = next(i for i, r in enumerate(rows) if r.get("switched"))
    assert first < 4 and all(r["mode"] == "on_policy" for r in rows[first:])
    assert all(r["tail/long_round"] is None for r in rows[:first])  # one record shape: null before the fallback
    assert any(r["tail/deferred_groups"] for r in rows[first + 1:]) or any(r["tail/long_round"] for r in rows[first + 1:])
    for s in trainer.steps[first + 1:]:  # the fallback's first step completes the verified prefixes it kept
        assert all((ver == s["version"]).all() for _, ver in s["tokens"])
    loop.ledger.check(loop.buffer)
