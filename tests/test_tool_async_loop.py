"""Pure-logic tests of tool turns under the asynchronous schedule (rollverify/async_loop.py over the run's
`Rollout`) against the scripted multi-turn engine of tests/tool_fakes.py.

The trainer's calls complete a fixed number of polls after they start (`LaterCalls`), so the engines generate
while the trainer works and a response in flight at a publish continues under the next version: mixed-version
trajectories by construction. The tool's gate holds every call until the test opens it, so what is in flight at a
publish is fixed by the engine's seeded script, not by timing. tests/test_tool_rollout.py runs the same schedule
on a real SGLang server, trainer and tool.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes import ScriptedTrainer
from tool_fakes import ENV_LEN, STOP, EchoTool, ToolEngine, WordCodec, check_turns

from rollverify.async_loop import AsyncLoop
from rollverify.environment.tools import ToolRegistry
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.tool_turns import ToolsConfig, ToolTurns
from rollverify.types import ENVIRONMENT, POLICY, Group
from rollverify.verify import two_stage_verify


class _Later:
    def __init__(self, result: Any, polls: int) -> None:
        self._result, self.left = result, polls

    def done(self) -> bool:
        self.left -= 1
        return self.left < 0

    def wait(self, timeout: float) -> None:
        self.left = -1

    def result(self) -> Any:
        return self._result


class LaterCalls:
    """Each trainer call runs at once and reports done after `polls` looks: the engines generate meanwhile."""

    def __init__(self, polls: int = 6) -> None:
        self.polls = polls

    def start(self, fn, *args, **kwargs) -> _Later:
        return _Later(fn(*args, **kwargs), self.polls)

    def close(self) -> None:
        pass


class AsyncTrainer(ScriptedTrainer):
    """The scripted trainer with the old-log-prob pass ahead of the step; keeps each step's responses."""

    def __init__(self, drift: float) -> None:
        super().__init__(drift)
        self.trained: list[list] = []

    def old_logprobs(self, responses, temperature):
        return self.compute_logprobs(responses, temperature)

    def train_step(self, responses, advantages, temperature, policy_version, old_logprobs=None):
        if old_logprobs is None:  # the alternating fallback's step recomputes them
            old_logprobs = self.compute_logprobs(responses, temperature)
        self.trained.append([(r.response_id, r.token_ids.copy(), r.versions.copy(), r.sources.copy(),
                              r.logprobs.copy(), np.asarray(old)) for r, old in zip(responses, old_logprobs, strict=True)])
        return super().train_step(responses, advantages, temperature, policy_version)


class SyncToolEngine(ToolEngine):
    """The scripted tool engine with every tool call started before a poll returned by that poll (unless the
    tool's gate holds it), so that outputs arrive where the engine's script puts them, not where the runner's
    threads do. Its `compute_logprobs` (engine-side verification) returns the engine's own log-probs, far off at
    the positions `hot` names (response id -> token index)."""

    def __init__(self) -> None:
        super().__init__()
        self.hot: dict[str, int] = {}
        self.tools: ToolTurns | None = None
        self.tool: EchoTool | None = None

    def wait_finished(self, timeout):
        if self.tools is not None and self.tool is not None and self.tool.gate.is_set():
            for call in list(self.tools.pending.values()):
                call.future.result(timeout=30)
        return super().wait_finished(timeout)

    def compute_logprobs(self, responses):
        out = []
        for r in responses:
            lp = r.logprobs.copy()
            if r.response_id in self.hot:
                lp[self.hot[r.response_id]] += 5.0
            out.append(lp)
        return out


_made: list[tuple[EchoTool, ToolTurns]] = []


@pytest.fixture(autouse=True)
def _open_gates():
    """A test that fails with its tool's gate closed leaves no call blocked behind it."""
    yield
    for tool, tools in _made:
        tool.gate.set()
        tools.close()
    _made.clear()


def make(mode: str = "partial", *, drift: float = 0.0, closed: bool = False, **algo):
    engine, trainer, tool = SyncToolEngine(), AsyncTrainer(drift), EchoTool(0.0)
    engine.appended = []
    if closed:
        tool.gate.clear()
    cfg = RolloutConfig(batch_groups=4, n=2, max_new_tokens=96, max_live=48, wait_s=0.0, phase_timeout_s=20)
    tools = ToolTurns(ToolsConfig(max_turns=3, time_limit_s=5.0, max_env_tokens=32), ToolRegistry([tool]),
                      WordCodec())
    rollout = Rollout(cfg, engine, trainer, make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                      reward=lambda group, response: float(response.num_tokens % 2), tools=tools)
    loop = AsyncLoop(AlgoConfig(mode=mode, schedule="async", **algo), rollout, calls=LaterCalls())
    engine.tools, engine.tool = tools, tool
    _made.append((tool, tools))
    return loop, engine, tool, trainer


def waiting_calls(loop: AsyncLoop) -> dict[str, int]:
    """Response id -> its length at its pending call's stop token, for every call in flight."""
    return {rid: loop.buffer.get(rid).num_tokens for rid in loop.tools.pending}


@pytest.mark.parametrize("mode", ["partial", "rollverify"])
def test_async_tool_turns_keep_both_ledgers_exact_and_every_output_in_place(mode):
    loop, engine, tool, trainer = make(mode, drift=0.005 if mode == "rollverify" else 0.0, d_s=0.01, d_t=0.5,
                                       conditional_switch=False)
    trained_env, rows = 0, []
    for _ in range(8):
        result = loop.run_step()  # Ledger.check runs inside: policy and environment tokens balance apart
        rows.append(result.metrics)
        assert result.metrics["schedule"] == "async"
        for g in result.trained_groups:
            for r in g.responses:
                check_turns(r, ENV_LEN, 3)
                trained_env += r.num_env_tokens
    led = loop.ledger
    assert led.env_tokens > 0 and led.trained_env_tokens == trained_env > 0
    for g in loop.buffer.groups.values():
        for r in g.responses:
            check_turns(r, ENV_LEN, 3)
    trained = [x for step in trainer.trained for x in step]
    if mode == "partial":  # generated while the trainer worked and continued after a publish: two versions
        assert max(len(np.unique(ver[src == POLICY])) for _, _, ver, src, _, _ in trained) >= 2
    else:  # every policy token verified against the step's policy (the old log-probs it trained with)
        for _, _, ver, src, lp, old in trained:
            p = src == POLICY
            keep = two_stage_verify(old[p], lp[p], ver[p], np.array([int(p.sum())]), 0.01, 0.5).keep_lengths
            assert int(keep[0]) == int(p.sum())
        assert led.cut_tokens > 0  # drift cut carried prefixes, and the ledger balanced through every cut
    assert all(0 <= m["acceptance_rate"] <= 1 for m in rows)  # policy tokens kept of policy tokens verified


def test_a_call_in_flight_at_a_publish_delivers_once_after_it_under_the_new_version():
    loop, engine, tool, trainer = make("partial", closed=True, max_staleness=100)
    m = loop.run_step().metrics  # the gate is closed: every call started before the publish is still in flight
    waiting = waiting_calls(loop)
    assert waiting and m["tools/waiting"] == len(waiting) and m["policy_version"] == 1
    for rid, end in waiting.items():  # the call's turn was generated before the publish
        r = loop.buffer.get(rid)
        assert r.token_ids[end - 1] == STOP and (r.versions[r.sources == POLICY] == 0).all()
    tool.gate.set()
    outputs = 0
    for _ in range(5):
        outputs += int(loop.run_step().metrics["tools/outputs"])
    loop.settle_tools()
    outputs += loop.tools.stats.outputs
    assert tool.runs == outputs  # every call ran once: none lost at the publish, none run twice
    final = {rid: (tok, ver, src) for step in trainer.trained for rid, tok, ver, src, _, _ in step}
    final.update({r.response_id: (r.token_ids, r.versions, r.sources)
                  for g in loop.buffer.groups.values() for r in g.responses})
    continued = 0
    for rid, end in waiting.items():
        tok, ver, src = final[rid]
        env = np.flatnonzero(src == ENVIRONMENT)
        assert len(env) and env[0] == end  # its output follows its call (partial cuts nothing)
        after = ver[end + ENV_LEN:][src[end + ENV_LEN:] == POLICY]
        assert (ver[:end] == 0).all() and (after >= 1).all()
        continued += len(after) > 0
    assert continued  # trajectories went on after their output, under the version published meanwhile
    loop.ledger.check(loop.buffer)


def test_a_publish_that_restarts_a_waiting_response_discards_its_call():
    """The staleness bound restarts every carried response at the publish, those waiting on a call included:
    the call's output never arrives, the trajectory starts again from its prompt."""
    loop, engine, tool, trainer = make("partial", closed=True, max_staleness=0)
    m = loop.run_step().metrics
    assert m["n_restarted_stale"] > 0 and m["tools/discarded"] > 0 and not loop.tools.pending
    tool.gate.set()
    for _ in range(3):
        loop.run_step()
    for g in loop.buffer.groups.values():
        for r in g.responses:
            check_turns(r, ENV_LEN, 3)  # no output landed where its call was cut away


def test_engine_side_verification_cuts_inside_a_waiting_call_and_keeps_a_whole_one():
    """With `verify_on: engine` the publish verifies the paused responses and those waiting on a call under the
    new weights: a cut at a waiting response's call token drops the call's output, a response kept whole still
    gets it."""
    loop, engine, tool, trainer = make("rollverify", closed=True, verify_on="engine",
                                       seq_stage=False, d_t=2.0, conditional_switch=False, max_staleness=100)
    chosen: dict[str, dict[str, int]] = {}
    update = engine.update_weights

    def publish(buckets, version):  # the new weights arrive: the verification that follows sees `hot`
        if not chosen:
            waiting = waiting_calls(loop)
            ids = sorted(waiting)
            assert len(ids) >= 2, "calls in flight at the first publish"
            chosen["cut"] = {rid: waiting[rid] - 1 for rid in ids[::2]}  # the call's own stop token
            chosen["kept"] = {rid: waiting[rid] for rid in ids[1::2]}
            engine.hot = dict(chosen["cut"])
        update(buckets, version)

    engine.update_weights = publish
    m = loop.run_step().metrics
    engine.hot = {}
    cut, kept = chosen["cut"], chosen["kept"]
    assert m["engine_verify/cut_tokens"] > 0 and m["tools/discarded"] == len(cut)
    for rid, at in cut.items():
        assert not loop.tools.waiting(rid) and loop.buffer.get(rid).num_tokens == at
    for rid in kept:
        assert loop.tools.waiting(rid)
    tool.gate.set()
    loop.settle_tools()
    for rid, end in kept.items():  # its output, in place
        r = loop.buffer.get(rid)
        assert r.sources[end] == ENVIRONMENT and r.token_ids[end - 1] == STOP
    for _ in range(3):
        loop.run_step()  # the ledger of both kinds holds after each
    for g in loop.buffer.groups.values():
        for r in g.responses:
            check_turns(r, ENV_LEN, 3)


def test_low_acceptance_hands_the_same_rollout_with_its_tool_turns_to_the_fallback():
    # d_s = 0: every segment fails, so the switch fires at the first verification round
    loop, engine, tool, trainer = make("rollverify", closed=True, d_s=0.0, switch_window=1, fallback="alternating",
                                       max_staleness=100)
    rollout = loop.rollout
    rows = [loop.run_step().metrics]
    assert rows[0]["switched"] and rows[0]["schedule"] == "alternating"
    assert loop.fallback is not None and loop.fallback.rollout is rollout and loop.tools is rollout.tools
    tool.gate.set()
    rows += [loop.run_step().metrics for _ in range(4)]  # the alternating loop, tool turns and ledger intact
    assert all(r["schedule"] == "alternating" for r in rows)
    assert [r["policy_version"] for r in rows] == list(range(1, 6))
    assert sum(r["tools/outputs"] for r in rows) > 0 and rollout.ledger.trained_env_tokens > 0
    assert all(sorted(r) == sorted(rows[0]) for r in rows)  # one record shape for the run
    for g in rollout.buffer.groups.values():
        for r in g.responses:
            check_turns(r, ENV_LEN, 3)
