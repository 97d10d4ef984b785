"""Pure-logic tests of the loop's tool turns (rollverify/tool_turns.py) against a scripted multi-turn engine.

The fakes stand in for nothing the tests claim to test (the real engine, trainer and sandboxed tool run the same
loop in tests/test_tool_rollout.py): the point is the loop's bookkeeping over many steps in well under a second
each: calls run while others generate, every output appended once and in place, cuts that drop a pending call's
output, the ledger of both token kinds, and a restore that finds a trajectory waiting on a call.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import ScriptedTrainer
from tool_fakes import ENV_LEN, STOP, ToolEngine, WordCodec, check_turns, make_tool_loop

from rollverify.buffer import RolloutBuffer
from rollverify.environment.tool_calls import format_tool_call
from rollverify.loop import Loop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.tool_turns import ToolsConfig, ToolTurns
from rollverify.types import ENVIRONMENT, POLICY, Group


@pytest.mark.parametrize("mode", ["on_policy", "partial", "rollverify"])
def test_tool_turns_keep_both_ledgers_exact_and_every_output_in_place(mode):
    loop, engine, tool = make_tool_loop(mode, drift=0.005 if mode == "rollverify" else 0.0,
                                        d_s=0.01, d_t=0.5, conditional_switch=False)
    env_len = ENV_LEN
    appended_in_training = 0
    for _ in range(8):
        result = loop.run_step()  # Ledger.check runs inside: policy and environment tokens balance apart
        m = result.metrics
        for g in result.trained_groups:
            for r in g.responses:
                check_turns(r, env_len, 3)
                appended_in_training += r.num_env_tokens
        assert m["tools/outputs"] <= m["tools/calls"] + 8 * 4 * 2  # outputs of calls started earlier too
    led = loop.ledger
    assert led.env_tokens > 0 and led.trained_env_tokens == appended_in_training
    for g in loop.buffer.groups.values():
        for r in g.responses:
            check_turns(r, env_len, 3)


def test_a_pause_finds_calls_in_flight_and_their_outputs_arrive_once():
    """The first phase ends with calls running; they finish after the pause, and the next rollout appends each
    output once (the tool ran once per output: none lost, none run twice)."""
    loop, engine, tool = make_tool_loop("partial", closed=True)
    m = loop.run_step().metrics
    in_flight = sorted(loop.tools.pending)
    assert m["tools/waiting"] == len(in_flight) > 0
    outputs, ended = int(m["tools/outputs"]), int(m["tools/ended_by_budget"])
    tool.gate.set()
    for _ in range(5):
        m = loop.run_step().metrics
        outputs += int(m["tools/outputs"])
        ended += int(m["tools/ended_by_budget"])
    for rid in in_flight:  # appended in place after the pause, exactly once
        try:
            check_turns(loop.buffer.get(rid), ENV_LEN, 3)
        except KeyError:
            pass  # trained: checked with its batch below
    loop.settle_tools()
    outputs += loop.tools.stats.outputs
    ended += loop.tools.stats.ended_by_budget
    assert tool.runs == outputs and not loop.tools.pending
    assert len(engine.appended) + ended == outputs
    loop.ledger.check(loop.buffer)


def test_a_cut_before_the_call_drops_its_output_and_one_after_keeps_it():
    loop, engine, tool = make_tool_loop("partial", closed=True)
    loop.run_step()
    waiting = [loop.buffer.get(rid) for rid in loop.tools.pending]
    assert len(waiting) >= 2, "slow calls in flight at the end of the step"
    cut, kept = waiting[0], waiting[1]
    keep_len = int(np.flatnonzero(cut.token_ids == STOP)[-1])  # cut at the pending call's own token
    decisions = {cut.response_id: keep_len}
    loop.ledger.cut(loop.buffer.apply_truncation(decisions))
    loop.tools.forget_cut(loop.buffer)
    engine.truncate(decisions)
    assert not loop.tools.waiting(cut.response_id) and loop.tools.waiting(kept.response_id)
    env_before = cut.num_env_tokens
    tool.gate.set()
    loop.settle_tools()
    assert cut.num_env_tokens == env_before and cut.num_tokens == keep_len  # its output never arrived
    assert kept.sources[-1] == ENVIRONMENT and kept.token_ids[-kept.num_env_tokens:].size
    assert loop.tools.stats.discarded == 1
    loop.ledger.check(loop.buffer)


def test_a_restored_trajectory_waiting_on_a_call_runs_it_again_and_goes_on(tmp_path):
    loop, engine, tool = make_tool_loop("partial", closed=True)
    loop.run_step()
    assert loop.tools.pending
    waiting = sorted(loop.tools.pending)
    loop.buffer.save(tmp_path / "b.npz")  # a checkpoint written without settling: the calls are lost with it
    state = loop.state()
    tool.gate.set()
    loop.tools.close()

    loop2, engine2, tool2 = make_tool_loop("partial", delay_s=0.0)
    loop2.trainer.version = loop.trainer.version
    loop2.restore(state, RolloutBuffer.load(tmp_path / "b.npz"))
    for _ in range(3):
        loop2.run_step()
    assert tool2.runs >= len(waiting)
    for rid in waiting:
        try:
            r = loop2.buffer.get(rid)
        except KeyError:
            continue  # trained since
        # its call ran again: its output follows it, the call is running, or the trajectory ended at it
        assert r.sources[-1] == ENVIRONMENT or r.token_ids[-1] != STOP or loop2.tools.waiting(rid) or r.finished


def test_max_turns_ends_a_trajectory_at_its_call():
    loop, engine, tool = make_tool_loop("partial", max_turns=1)
    ended = 0
    for _ in range(6):
        result = loop.run_step()
        ended += int(result.metrics["tools/ended_by_turns"])
        for g in result.trained_groups:
            for r in g.responses:
                assert r.num_env_runs <= 1 and r.finished
                if r.num_env_runs == 1 and r.token_ids[-1] == STOP:  # its second call: no output, finished
                    assert r.finish_reason == "stop" and r.sources[-1] == POLICY
    assert ended > 0
    assert all(r.num_env_runs <= 1 for g in loop.buffer.groups.values() for r in g.responses)


HOSTILE = [
    "while True:\n    pass",  # a runaway: the CPU limit
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",  # kill its parent
    "print('x' * (100 << 20))",  # a 100 MiB print
    "b = []\nwhile True:\n    b.append(bytearray(8 << 20))",  # a memory bomb
]


class HostileCodec(WordCodec):
    """Every call the policy makes runs one of the hostile programs in the real sandboxed Python tool."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if i == STOP:
                out.append(format_tool_call("python", {"code": HOSTILE[self.n % len(HOSTILE)]}))
                self.n += 1
        return "".join(out)


@pytest.mark.system
def test_hostile_tool_calls_in_a_run_are_error_text_and_the_run_goes_on():
    from rollverify.environment.limits import SandboxLimits
    from rollverify.environment.tools import default_registry

    engine, trainer = ToolEngine(), ScriptedTrainer(0.0)
    engine.appended = []
    cfg = RolloutConfig(batch_groups=2, n=2, max_new_tokens=400, max_live=8, wait_s=0.0, phase_timeout_s=120)
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=128 << 20, stdout_bytes=256)
    tools = ToolTurns(ToolsConfig(max_turns=2, time_limit_s=4.0, max_env_tokens=64, max_concurrent=4),
                      default_registry(limits), HostileCodec())
    loop = Loop(AlgoConfig(mode="partial"),
                Rollout(cfg, engine, trainer, make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                        reward=lambda group, response: 0.0, tools=tools))
    errors = outputs = 0
    for _ in range(2):
        m = loop.run_step().metrics  # the ledger of both kinds holds after each
        errors += int(m["tools/errors"])
        outputs += int(m["tools/outputs"])
    loop.settle_tools()
    errors += loop.tools.stats.errors
    outputs += loop.tools.stats.outputs
    assert outputs > 0 and errors == outputs  # every hostile call: an error result, inside its limits
    words = set(loop.tools.codec.words)
    assert any("killed" in w or "SIGXCPU" in w or "MemoryError" in w or "exit" in w for w in words), sorted(words)[:40]
    tools.close()
