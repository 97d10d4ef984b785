"""The scripted multi-turn parts the tool-turn logic tests share: a word codec, an echo tool, an engine whose
responses stop at a tool-call tag, a loop over them, and the check of a finished trajectory's turns."""

from __future__ import annotations

import threading
import time

import numpy as np
from fakes import ScriptedEngine, ScriptedTrainer

from rollverify.environment.tool_calls import TOOL_CALL_CLOSE, format_tool_call
from rollverify.environment.tools import ToolOutput, ToolRegistry
from rollverify.loop import Loop
from rollverify.rollout import Rollout, RolloutConfig
from rollverify.strategies import AlgoConfig
from rollverify.tool_turns import ToolsConfig, ToolTurns
from rollverify.types import ENVIRONMENT, POLICY, Group

STOP = 99  # the tool-call tag's one token
ENV_LEN = 8  # words of one echo output's environment text (its tool-response turn and the next prompt)


class WordCodec:
    """One token per whitespace-separated word; the call tag is STOP, and decoding STOP gives a whole call."""

    def __init__(self) -> None:
        self.words: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        if text == TOOL_CALL_CLOSE:
            return [STOP]
        return [self.words.setdefault(w, 100 + len(self.words)) for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(format_tool_call("echo", {"x": 1}) if i == STOP else "a" for i in ids)


class EchoTool:
    name = "echo"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.runs = 0
        self.lock = threading.Lock()
        self.gate = threading.Event()  # a call returns once it is set
        self.gate.set()

    def schema(self) -> dict:
        return {}

    def run(self, arguments, time_limit_s) -> ToolOutput:
        with self.lock:
            self.runs += 1
        time.sleep(self.delay_s)
        self.gate.wait()
        return ToolOutput(text=f"echo {arguments}", ok=True)


class ToolEngine(ScriptedEngine):
    """Each response makes a long-tailed number of calls (0 to 5): a turn ends with the call token and a "stop"
    finish; `append` adds the environment tokens and continues it (a later launch's tokens)."""

    def submit(self, responses, sampling):
        assert STOP in sampling.stop_token_ids
        super().submit(responses, sampling)
        for r in responses:
            self.tracked[r.response_id]["calls"] = min(5, int(self.rng.pareto(1.0)))

    def _chunk(self, rid, reason):
        c = super()._chunk(rid, reason)
        st = self.tracked[rid]
        if reason == "stop" and st.pop("call_now", False):
            c.token_ids[-1] = STOP
        return c

    def wait_finished(self, timeout):
        if self.paused:
            return []
        for rid in self.live:
            st = self.tracked[rid]
            if st["calls"] and st["len"] + self.speed >= st["target"] and st["len"] < st["target"]:
                st["calls"] -= 1
                st["call_now"] = True
        return super().wait_finished(timeout)

    def append(self, tokens):
        for rid, ids in tokens.items():
            st = self.tracked[rid]
            assert st["done"] or (self.paused and not st["new"]), f"append to {rid} while it generates"
            st["len"] += len(ids)
            assert st["len"] < st["budget"]
            st["done"] = False
            st["target"] = st["len"] + self._target(st["budget"] - st["len"])
            self.appended.append(rid)

    appended: list = []


def make_tool_loop(mode: str, delay_s: float = 0.0, drift: float = 0.0, max_turns: int = 3, closed: bool = False,
                   **algo):
    """closed: the tool's calls wait until the test opens `tool.gate` (what is in flight at a pause is then
    fixed by the engine's seeded script, not by timing)."""
    engine, trainer = ToolEngine(), ScriptedTrainer(drift)
    engine.appended = []
    tool = EchoTool(delay_s)
    if closed:
        tool.gate.clear()
    cfg = RolloutConfig(batch_groups=4, n=2, max_new_tokens=96, max_live=48, wait_s=0.0, phase_timeout_s=20)
    tools = ToolTurns(ToolsConfig(max_turns=max_turns, time_limit_s=5.0, max_env_tokens=32), ToolRegistry([tool]),
                      WordCodec())
    loop = Loop(AlgoConfig(mode=mode, **algo),
                Rollout(cfg, engine, trainer, make_group=lambda gid: Group.new(gid, [3, 4, 5], cfg.n, cfg.max_new_tokens),
                        reward=lambda group, response: float(response.num_tokens % 2), tools=tools))
    return loop, engine, tool


def env_runs(r) -> list[tuple[int, int]]:
    """(start, end) of each run of environment tokens."""
    env = np.concatenate([[0], (r.sources == ENVIRONMENT).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(env))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def check_turns(r, env_len: int, max_turns: int) -> None:
    """Every output follows its call token, has the whole output's length, and every call but a last one past
    max_turns (or one at the end of a response that stopped short of its output) has its output after it."""
    runs = env_runs(r)
    assert len(runs) <= max_turns
    for a, b in runs:
        assert r.token_ids[a - 1] == STOP and r.sources[a - 1] == POLICY
        assert b - a == env_len, "an output appended twice, or cut in part"
    calls = np.flatnonzero((r.token_ids == STOP) & (r.sources == POLICY))
    answered = {a - 1 for a, _ in runs}
    assert set(calls.tolist()) - answered <= {r.num_tokens - 1}
