"""`algo.verify_on: engine`: the engines compute the new log-probs of carried tokens (`compute_logprobs`).

Here: the server op's answers and refusals on the fake engine, holding and releasing responses while the server
runs, its routing across two servers, and the loop's order with scripted components (weights first, no trainer
forward, the next step's new groups generating while the carried responses are held, the engines' copies cut to
the buffer's, a server lost meanwhile). The real SGLang
engine against the real Megatron-Core trainer (per-token agreement, the same cuts, the exact ledger over steps)
is `tests/test_train_e2e.py::test_engine_side_verification_matches_the_trainer_with_exact_accounting`.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from engine_fixtures import FakeEngine, FakeServer, run
from fakes import ScriptedEngine, ScriptedTrainer

from rollverify.app.config import ConfigError, load_config
from rollverify.buffer import RolloutBuffer
from rollverify.loop import Loop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.types import Group
from sglang_ext.client import ControlError, ServerConnection, SubmitRequest
from sglang_ext.engine import PrefillRequest
from sglang_ext.protocol import ErrorCode, WireSamplingParams
from sglang_ext.rollout_engine import SGLangRolloutEngine

IGNORE_EOS = WireSamplingParams(ignore_eos=True)


class PrefillingEngine(FakeEngine):
    """FakeEngine with prefill log-probs: each input token's log-prob is what generation reports for it under the
    same weights (as SGLang's are, in float32); `fail` makes the engine refuse them."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.prefills: list[tuple[int, int]] = []  # (input length, start) per engine request
        self.fail = False

    async def input_logprobs(self, requests: list[PrefillRequest]) -> list[np.ndarray]:
        await asyncio.sleep(self.step_s)
        if self.fail:
            raise RuntimeError("SGLang refused the log-prob request")
        self.prefills += [(len(r.input_ids), r.start) for r in requests if r.start < len(r.input_ids)]
        return [
            np.array([self.logprob(t, j) for j, t in enumerate(r.input_ids) if j >= r.start], np.float32)
            for r in requests
        ]


def _record(buffer: RolloutBuffer, chunks) -> None:
    for c in chunks:
        buffer.record(c.response_id, c.token_ids, c.logprobs, c.versions, c.routed_experts, finish_reason=c.finish_reason)


def _finish(engine, buffer: RolloutBuffer, responses, timeout_s: float = 30.0) -> None:
    """Record the engine's output until every one of `responses` has finished."""
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in responses):
        assert time.monotonic() < deadline, [r.num_tokens for r in responses]
        _record(buffer, engine.wait_finished(0.2))


def test_compute_logprobs_routes_by_id_across_servers_and_follows_the_weights():
    import torch

    fakes = [PrefillingEngine(step_s=0.002), PrefillingEngine(step_s=0.002)]
    with (
        FakeServer(fakes[0]) as s0,
        FakeServer(fakes[1]) as s1,
        SGLangRolloutEngine([s0.endpoint, s1.endpoint], poll_wait_s=0.1) as engine,
    ):
        buffer = RolloutBuffer()
        for g in range(4):
            buffer.add_group(Group.new(g, [5 + g, 6, 7], 2, 400))
        buffer.add_group(Group.new(4, [5, 6], 2, 6))  # finishes first: the long ones have tokens by then
        engine.submit(buffer.pending(), IGNORE_EOS)
        _finish(engine, buffer, buffer.groups[4].responses)
        _record(buffer, engine.pause())
        buffer.add_group(Group.new(9, [8, 9], 1, 400))  # submitted while paused: no tokens yet
        engine.submit(buffer.groups[9].responses, IGNORE_EOS)
        responses = [r for g in buffer.groups.values() for r in g.responses][::-1]
        assert {engine.where[r.response_id].index for r in responses} == {0, 1}
        assert all(r.num_tokens > 0 for r in responses[1:]) and responses[0].num_tokens == 0

        # same weights: exactly the log-probs generation reported, in the order asked
        got = engine.compute_logprobs(responses)
        assert [len(x) for x in got] == [r.num_tokens for r in responses]
        for r, lp in zip(responses, got, strict=True):
            assert np.array_equal(lp, r.logprobs), r.response_id
        prefills = sorted(fakes[0].prefills + fakes[1].prefills)
        assert prefills == sorted((len(r.prompt_ids) + r.num_tokens, len(r.prompt_ids)) for r in responses[1:])

        # new weights: the new policy's log-probs of the same tokens; the responses themselves are unchanged
        engine.update_weights(iter([[("lm_head.weight", torch.zeros(128, 8))]]), 1)
        got = engine.compute_logprobs(responses)
        for r, lp in zip(responses[1:], got[1:], strict=True):
            p = len(r.prompt_ids)
            want = [fakes[0].logprob(int(t), p + j) for j, t in enumerate(r.token_ids)]  # salt 1 on both fakes
            assert np.allclose(lp, want) and not np.array_equal(lp, r.logprobs)
        buffer.add_group(Group.new(5, [5, 6], 1, 4))
        engine.submit(buffer.groups[5].responses, IGNORE_EOS)
        engine.resume()
        _finish(engine, buffer, buffer.groups[5].responses)  # generation goes on under version 1
        assert (buffer.get("5-0").versions == 1).all()


def test_compute_logprobs_refuses_bad_input_changes_nothing_and_keeps_serving():
    fake = PrefillingEngine(step_s=0.002)
    with FakeServer(fake) as s:

        async def main():
            conn = await ServerConnection(s.endpoint, timeout_s=10).start()

            async def refused(code: str, words: str, rids, **kw):
                with pytest.raises(ControlError) as e:
                    await conn.compute_logprobs(rids, **kw)
                assert e.value.code == code and words in e.value.message, e.value
                return e.value

            try:
                await conn.submit([SubmitRequest("a", [5, 6], 500), SubmitRequest("s", [5, 6], 3)],
                                  {"ignore_eos": True})
                err = await refused(ErrorCode.RESPONSE_RUNNING, "['a'] (1) while they generate", ["a"])
                assert err.details["rids"] == ["a"]
                await conn.events(0, wait_s=10)  # "s" finished: "a" has tokens
                await conn.pause()
                await conn.submit([SubmitRequest("t", [5, 6], 50)], {"temperature": 0.7})
                batch, _ = await conn.fetch(["a"])
                before = batch.token_ids.copy()
                err = await refused(ErrorCode.UNKNOWN_RESPONSE, "unknown response id(s) ['zz']", ["a", "zz"])
                assert err.details["rids"] == ["zz"]
                await refused(ErrorCode.INVALID, "more than once", ["a", "a"])
                await refused(ErrorCode.INVALID, "rids", [])
                await refused(ErrorCode.VERSION_MISMATCH, "expects weights version 3 but the server serves 0", ["a"],
                              expect_version=3)
                await refused(ErrorCode.INVALID, "temperature 0.7", ["a", "t"])
                fake.fail = True
                await refused(ErrorCode.ENGINE_ERROR, "SGLang refused the log-prob request", ["a"])
                fake.fail = False
                assert len(fake.prefills) == 0  # every refusal came before any engine work

                lps, body = await conn.compute_logprobs(["a"], expect_version=0)
                assert body["version"] == 0 and body["tokens"] == len(before) == len(lps[0]) > 0
                batch, _ = await conn.fetch(["a"])
                assert np.array_equal(batch.token_ids, before) and np.array_equal(batch.logprobs, lps[0])
                assert (await conn.health())["ok"]
                await conn.resume()  # the response generates on from where it was
                await conn.submit([SubmitRequest("s2", [5, 6], 3)], {"ignore_eos": True})
                batch, last = await conn.events(0, wait_s=10)
                while "s2" not in batch.rids:
                    batch, last = await conn.events(last, wait_s=10)
                batch, _ = await conn.pause()
                a = batch.rids.index("a")
                assert batch.offsets[a] == len(before) and batch.counts[a] > 0
            finally:
                await conn.close()

        run(main(), 60)


def test_held_responses_wait_while_the_server_runs_and_launch_when_released():
    """resume(hold) runs the server but keeps the held responses paused: their log-probs and truncation work
    while the rest generates, and resume(rids) launches them from the cut prefix. Bad input is refused first."""
    fake = PrefillingEngine(step_s=0.002)
    with FakeServer(fake) as s:

        async def main():
            conn = await ServerConnection(s.endpoint, timeout_s=10).start()

            async def refused(code: str, words: str, **kw):
                with pytest.raises(ControlError) as e:
                    await conn.resume(**kw)
                assert e.value.code == code and words in e.value.message, e.value

            async def states(rids):
                return dict(zip(rids, (await conn.fetch(rids))[1]["states"], strict=True))

            try:
                await conn.submit([SubmitRequest(r, [5, 6], 500) for r in "ab"], {"ignore_eos": True})
                await conn.submit([SubmitRequest("s", [5, 6], 5)], {"ignore_eos": True})
                await conn.events(0, wait_s=10)  # "s" finished: "a" and "b" have tokens
                await conn.pause()
                await refused(ErrorCode.INVALID, "server is paused: resume it first", rids=["a"])
                await refused(ErrorCode.INVALID, "not paused: [('s', 'finished')]", hold=["a", "s"])
                await refused(ErrorCode.UNKNOWN_RESPONSE, "['zz']", hold=["zz"])
                with pytest.raises(ControlError, match="not both"):
                    await conn.call("resume", {"hold": ["a"], "rids": ["b"]})
                assert await states(["a", "b"]) == {"a": "paused", "b": "paused"}  # the refusals changed nothing

                body = await conn.resume(hold=["a"])
                assert body["resumed"] == 1 and await states(["a", "b"]) == {"a": "paused", "b": "running"}
                await refused(ErrorCode.NOT_PAUSED, "not paused")
                await refused(ErrorCode.INVALID, "not paused: [('b', 'running')]", rids=["a", "b"])
                (a_before,), _ = await conn.compute_logprobs(["a"])  # while "b" generates
                with pytest.raises(ControlError) as e:
                    await conn.compute_logprobs(["b"])
                assert e.value.code == ErrorCode.RESPONSE_RUNNING
                await conn.truncate({"a": 2})
                batch, _ = await conn.fetch(["a"])
                assert np.array_equal(batch.logprobs, a_before[:2]) and await states(["a"]) == {"a": "paused"}

                assert (await conn.resume(rids=["a"]))["resumed"] == 1
                assert (await states(["a"]))["a"] in ("running", "finished")
                batch, last = await conn.events(0, wait_s=10)
                while "a" not in batch.rids:
                    batch, last = await conn.events(last, wait_s=10)
                a = batch.rids.index("a")
                assert batch.offsets[a] == 2 and batch.totals[a] == 500  # generated on from the kept prefix
            finally:
                await conn.close()

        run(main(), 60)


def drifted(r, version: int, drift: float) -> np.ndarray:
    """New log-probs: every token drifts with its staleness, every 7th 300 times as much (its OPS then fails
    d_t = 2 from one version of staleness on), so the token stage cuts responses in the middle."""
    spikes = 1.0 + 300.0 * (np.arange(r.num_tokens) % 7 == 6)
    return (r.logprobs + drift * (version - r.versions) * spikes).astype(np.float32)


class PrefillingScriptedEngine(ScriptedEngine):
    """ScriptedEngine that computes new log-probs (`drifted`); it records the weights version it serves at each
    call (the loop must have pushed the new one), which responses it was asked about and how many others were
    generating meanwhile."""

    def __init__(self, drift: float, **kw) -> None:
        super().__init__(**kw)
        self.drift = drift
        self.calls: list[tuple[int, list[str]]] = []
        self.generating: list[int] = []  # responses generating at each call

    def compute_logprobs(self, responses):
        assert self.paused or not {r.response_id for r in responses} & set(self.live), "of generating responses"
        self.calls.append((self.version, [r.response_id for r in responses]))
        self.generating.append(0 if self.paused else len(self.live))
        return [drifted(r, self.version, self.drift) for r in responses]


class CountingTrainer(ScriptedTrainer):
    """ScriptedTrainer with the same new log-probs as PrefillingScriptedEngine; records its forwards."""

    def __init__(self, drift: float) -> None:
        super().__init__(drift)
        self.forwards: list[list[str]] = []

    def compute_logprobs(self, responses, temperature):
        self.forwards.append([r.response_id for r in responses])
        return [drifted(r, self.version, self.drift) for r in responses]


def _loop(verify_on: str, drift: float = 0.006) -> Loop:
    """test_loop_logic.make_loop's run with the engine and trainer above, verified by the token stage."""
    cfg = RolloutConfig(batch_groups=4, n=2, max_new_tokens=64, max_live=24, wait_s=0.0, phase_timeout_s=5)
    return Loop(
        AlgoConfig(mode="rollverify", seq_stage=False, conditional_switch=False, verify_on=verify_on),
        Rollout(cfg, PrefillingScriptedEngine(drift), CountingTrainer(drift),
                make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                reward=lambda group, response: float(response.num_tokens % 2)),
    )


def test_engine_mode_pushes_weights_first_overlaps_new_groups_and_cuts_the_engine_s_copies():
    """Every step: the engines hold the new weights when they compute, the trainer computes nothing, the next
    step's new groups generate meanwhile (the carried responses held), and once released every response the
    engines hold is exactly as long as the buffer's verified copy (the cuts reached the engines first)."""
    loop = _loop("engine")
    engine = loop.engine
    cut_steps = 0
    for step in range(1, 9):
        m = loop.run_step().metrics  # Ledger.check runs inside
        assert m["n_carried"] > 0 and m["n_logprobs_on_engine"] == m["n_carried"]
        assert engine.calls[-1][0] == step  # the engines held the new weights when they computed
        assert m["n_launched_while_verifying"] > 0 and engine.generating[-1] > 0
        assert m["logprob_wait_s"] >= 0 and not engine.held and not engine.paused
        lengths = {rid: st["len"] for rid, st in engine.tracked.items()}
        assert lengths == {rid: loop.buffer.get(rid).num_tokens for rid in engine.response_ids()}
        cut_steps += m["verify/truncated"] > 0
    assert cut_steps > 0 and loop.trainer.forwards == []


def test_responses_the_engines_do_not_hold_are_verified_on_the_trainer():
    loop = _loop("engine")
    loop.run_step()
    loop.rollout_phase()  # the next phase, ending paused: what the step's verification finds
    carried = [r.response_id for r in loop.buffer.carried_over()]
    gone = carried[::2]
    loop.engine.drop(gone)  # as after a restore: the engines hold none of these
    m = loop.verify()
    assert loop.trainer.forwards == [gone]
    assert loop.engine.calls[-1][1] == [rid for rid in carried if rid not in gone]
    assert m["n_logprobs_on_engine"] == len(carried) - len(gone)


def test_responses_lost_while_held_are_verified_on_the_trainer_and_resubmitted_verified():
    """A server lost while the engines compute: its responses' log-probs come from the trainer, the rest's from
    the engines; the next rollout resubmits the unfinished lost ones from the buffer's verified prefixes."""
    loop = _loop("engine")
    loop.run_step()
    engine, compute = loop.engine, loop.engine.compute_logprobs
    gone: list[str] = []

    def lose_half(responses):
        gone.extend(r.response_id for r in responses[::2])
        for rid in gone:
            del engine.tracked[rid]
            engine.held.discard(rid)
        engine.lost_ids = list(gone)
        return [None if r.response_id in gone else lp for r, lp in zip(responses, compute(responses), strict=True)]

    engine.compute_logprobs = lose_half
    m = loop.run_step().metrics  # Ledger.check runs inside
    engine.compute_logprobs = compute
    assert 0 < len(gone) < m["n_carried"] and m["n_logprobs_on_engine"] == m["n_carried"] - len(gone)
    assert sorted(loop.trainer.forwards[-1]) == sorted(gone)
    verified = {rid: loop.buffer.get(rid).num_tokens for rid in gone if not loop.buffer.get(rid).finished}
    submit, resubmitted = engine.submit, {}
    engine.submit = lambda rs, sampling: resubmitted.update(
        {r.response_id: r.num_tokens for r in rs if r.response_id in verified}) or submit(rs, sampling)
    m = loop.run_step().metrics
    assert m["n_resubmitted"] == len(verified) > 0 and resubmitted == verified  # from the verified prefixes


def test_a_switch_during_engine_side_verification_drops_the_new_groups_it_does_not_keep():
    """The switch to on_policy can come from a verification during which new groups already generate: the groups
    beyond the B the next step completes leave the engines (running ones included) and restart later, and from
    then on every step completes what it launches, with the exact ledger throughout."""
    cfg = RolloutConfig(batch_groups=4, n=2, max_new_tokens=64, max_live=24, wait_s=0.0, phase_timeout_s=5)
    loop = Loop(
        AlgoConfig(mode="rollverify", verify_on="engine", switch_window=2, switch_tau=0.5),
        Rollout(cfg, PrefillingScriptedEngine(5.0), CountingTrainer(5.0),
                make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                reward=lambda group, response: float(response.num_tokens % 2)),
    )
    rows = [loop.run_step().metrics for _ in range(8)]  # Ledger.check runs inside
    switch = next(i for i, m in enumerate(rows) if m["switched"])
    assert rows[switch]["n_launched_while_verifying"] > 0  # new groups were generating when it switched
    assert [m["mode"] for m in rows[switch + 1:]] == ["on_policy"] * (7 - switch)
    assert not loop.buffer.groups and not loop.engine.tracked


def test_verify_on_is_checked_with_the_config():
    assert AlgoConfig().verify_on == "trainer"
    with pytest.raises(ValueError, match="algo.verify_on must be one of"):
        AlgoConfig(verify_on="gpu")
    assert load_config(None, ["algo.verify_on=engine"]).algo.verify_on == "engine"
    with pytest.raises(ConfigError, match="rollout.temperature 1, got 0.7"):
        load_config(None, ["algo.verify_on=engine", "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="trainer.replay_verify"):
        load_config(None, ["algo.verify_on=engine", "trainer.replay_verify=true"])
