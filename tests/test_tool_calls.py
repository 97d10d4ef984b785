"""Tool calls in the Qwen3 template's format, the tool registry and runner, and the code-execution reward."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rollverify.environment.code_reward import CodeTests, code_reward
from rollverify.environment.limits import MIB, SandboxLimits
from rollverify.environment.runner import RunnerLimits, ToolRunner
from rollverify.environment.sandbox import Sandbox
from rollverify.environment.tool_calls import (
    STOP_STRINGS,
    MalformedCall,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
    tool_response_text,
)
from rollverify.environment.tools import (
    TRUNCATION_MARKER,
    PythonTool,
    ToolOutput,
    ToolRegistry,
    default_registry,
    truncate_text,
)

# --- parsing -------------------------------------------------------------------------------------------------


def test_one_call_in_the_template_format():
    text = 'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 2)"}}\n</tool_call>'
    (call,) = parse_tool_calls(text)
    assert call == ToolCall(
        name="python",
        arguments={"code": "print(2 + 2)"},
        index=0,
        raw='\n{"name": "python", "arguments": {"code": "print(2 + 2)"}}\n',
    )
    assert format_tool_call("python", {"code": "print(2 + 2)"}) == text.removeprefix("Let me compute.\n")
    assert STOP_STRINGS == ("</tool_call>",)


def test_several_calls_keep_their_order_and_a_bad_one_does_not_hide_the_others():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        "<tool_call>\n{not json}\n</tool_call>\n"
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [type(c) for c in calls] == [ToolCall, MalformedCall, ToolCall]
    assert [c.index for c in calls] == [0, 1, 2]
    assert calls[0].arguments == {"x": 1} and calls[2].name == "b" and calls[2].arguments == {"y": 2}
    assert "not valid JSON" in calls[1].error


@pytest.mark.parametrize(
    "text,needle",
    [
        ('<tool_call>\n{"name": "python", "arguments": {"code": "1"}', "never closed"),
        ("<tool_call>\n[1, 2]\n</tool_call>", "JSON object"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '"name"'),
        ('<tool_call>\n{"name": "python", "arguments": [1]}\n</tool_call>', '"arguments"'),
        ('<tool_call>\n{"name": "python", "arguments": "not json"}\n</tool_call>', "not a JSON object"),
        ('<tool_call>\n<tool_call>\n{"name": "a"}\n</tool_call>', "inside another call"),
        ("stray </tool_call> here", "without"),
    ],
)
def test_malformed_calls_are_results_not_exceptions(text, needle):
    calls = parse_tool_calls(text)
    assert calls and isinstance(calls[0], MalformedCall) and needle in calls[0].error


def test_text_without_calls_has_none():
    assert parse_tool_calls("The answer is \\boxed{4}.") == []


# --- formatting ----------------------------------------------------------------------------------------------


def test_tool_responses_continue_the_conversation_as_the_qwen3_template_renders_it():
    # What the Qwen3 chat template renders for [user, assistant with two tool_calls, tool, tool] with
    # add_generation_prompt=True: both tool messages in one user turn, then the assistant prompt.
    user = "<|im_start|>user\nWhat is 2+2 and 3?<|im_end|>\n"
    policy = (
        "<|im_start|>assistant\nLet me compute.\n"
        + format_tool_call("python", {"code": "print(2+2)"})
        + "\n"
        + format_tool_call("python", {"code": "print(3)"})
    )
    expected = (
        user
        + policy
        + "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n3\n</tool_response>"
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert user + policy + tool_response_text(["4", "3"], turn_closed=False) == expected
    # The policy ended the turn itself with <|im_end|>: the environment does not close it again.
    assert user + policy + "<|im_end|>" + tool_response_text(["4", "3"], turn_closed=True) == expected
    no_think = tool_response_text(["4"], turn_closed=True, thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="at least one"):
        tool_response_text([], turn_closed=True)


def test_truncation_keeps_the_head_and_marks_the_cut():
    text = "".join(f"{i:04d}\n" for i in range(1000))
    cut, was_cut = truncate_text(text, 200)
    assert was_cut and len(cut) <= 200 and cut.startswith("0000\n0001\n")
    assert cut.endswith(TRUNCATION_MARKER.format(dropped=len(text) - cut.index("\n...[")))
    assert truncate_text("short", 200) == ("short", False)
    words = " ".join(["w"] * 500)
    cut, was_cut = truncate_text(words, None, max_tokens=50, count_tokens=lambda s: len(s.split()))
    assert was_cut and len(cut.split()) <= 50 and "truncated" in cut
    with pytest.raises(ValueError, match="count_tokens"):
        truncate_text(words, None, max_tokens=50)


# --- registry and runner -------------------------------------------------------------------------------------


class SleepTool:
    """Waits `seconds` (on an event, so a test can release it), then echoes its arguments."""

    def __init__(self, name: str = "sleep", seconds: float = 0.3, together: int | None = None) -> None:
        self.name = name
        self.seconds = seconds
        # With `together`, each call first waits (up to 10 s) until that many are running at once.
        self.gate = threading.Barrier(together) if together else None
        self.release = threading.Event()
        self.running = 0
        self.peak = 0
        self._lock = threading.Lock()

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "parameters": {"type": "object"}}}

    def run(self, arguments: dict, time_limit_s: float) -> ToolOutput:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            if self.gate is not None:
                self.gate.wait(timeout=10)
            self.release.wait(self.seconds)
            return ToolOutput(text=f"slept {arguments}", ok=True)
        finally:
            with self._lock:
                self.running -= 1


class CrashTool:
    name = "crash"

    def schema(self) -> dict:
        return {}

    def run(self, arguments: dict, time_limit_s: float) -> ToolOutput:
        raise RuntimeError("tool bug")


def call(name: str, index: int = 0, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, index=index, raw="")


def test_registry_names_aliases_and_refuses_duplicates():
    reg = default_registry()
    assert reg.names() == ["python"] and reg.get("code_interpreter") is reg.get("python")
    assert reg.schemas()[0]["function"]["parameters"]["required"] == ["code"]
    with pytest.raises(ValueError, match="registered already"):
        reg.register(PythonTool())
    with pytest.raises(ValueError, match="not registered"):
        reg.alias("py", "nope")


def test_calls_run_concurrently_while_the_caller_goes_on():
    n = 8
    # Each call waits until all n run at once (a pool that ran fewer would fail them), then takes 0.3 s.
    tool = SleepTool(seconds=0.3, together=n)
    with ToolRunner(ToolRegistry([tool]), RunnerLimits(max_workers=n, time_limit_s=20)) as runner:
        start = time.monotonic()
        futures = [runner.submit(call("sleep", i, i=i)) for i in range(n)]
        assert not any(f.done() for f in futures), "submit must return before its call ends"
        results = [f.result(timeout=30) for f in futures]
        elapsed = time.monotonic() - start
    assert [r.text for r in results] == [f"slept {{'i': {i}}}" for i in range(n)]
    assert all(r.ok and r.error is None for r in results)
    # every call waited until all n ran at once: concurrency by construction, whatever the machine's load
    assert tool.peak == n, f"only {tool.peak} of {n} calls ran at once"
    print(f"\n{n} calls of 0.3 s on a pool of {n}: {elapsed:.2f} s")


def test_a_pool_of_one_runs_calls_one_after_another():
    tool = SleepTool(seconds=0.05)
    with ToolRunner(ToolRegistry([tool]), RunnerLimits(max_workers=1, time_limit_s=5)) as runner:
        results = runner.run_all([call("sleep", i) for i in range(3)])
    assert all(r.ok for r in results) and tool.peak == 1


def test_the_pool_bounds_how_many_run_at_once_and_queued_calls_do_not_time_out():
    tool = SleepTool(seconds=0.2)
    # Eight calls of 0.2 s on two threads take 0.8 s, past the 0.6 s deadline if it counted from submit: only a
    # deadline counted from each call's own start lets the last queued ones succeed.
    with ToolRunner(ToolRegistry([tool]), RunnerLimits(max_workers=2, time_limit_s=0.5, grace_s=0.1)) as runner:
        results = runner.run_all([call("sleep", i) for i in range(8)])
    assert [r.error for r in results] == [None] * 8 and tool.peak == 2
    assert max(r.seconds for r in results) >= 0.6


def test_closing_the_runner_resolves_queued_calls():
    tool = SleepTool(seconds=60)
    runner = ToolRunner(ToolRegistry([tool]), RunnerLimits(max_workers=1, time_limit_s=60))
    running, queued = runner.submit(call("sleep", 0)), runner.submit(call("sleep", 1))
    deadline = time.monotonic() + 5
    while not tool.running and time.monotonic() < deadline:
        time.sleep(0.01)
    runner.close(wait=False)
    assert queued.result(timeout=5).text == "error: the tool runner was closed"
    assert running.result(timeout=5).error == "closed"
    tool.release.set()
    assert runner.submit(call("sleep", 2)).result(timeout=5).text == "error: the tool runner was closed"


def test_errors_and_time_outs_become_environment_text_delivered_once():
    slow = SleepTool(name="slow", seconds=60)
    reg = ToolRegistry([slow, CrashTool()])
    with ToolRunner(reg, RunnerLimits(time_limit_s=0.3, grace_s=0.1, max_workers=4)) as runner:
        start = time.monotonic()
        timed = runner.submit(call("slow"))
        crashed = runner.submit(call("crash"))
        unknown = runner.submit(call("nope"))
        malformed = runner.submit(MalformedCall(raw="{", error="the call is not valid JSON", index=3))
        results = {
            k: f.result(timeout=10)
            for k, f in [("t", timed), ("c", crashed), ("u", unknown), ("m", malformed)]
        }
        timed_after = time.monotonic() - start
        slow.release.set()  # the tool returns late: its result must not replace the time-out
        deadline = time.monotonic() + 5
        while slow.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow.running == 0 and timed.result() is results["t"]
    assert results["t"].error == "timeout" and "timed out after 0.3 s" in results["t"].text
    assert timed_after < 3, f"the time-out came {timed_after:.2f} s after submit"
    assert results["c"].error == "tool_crashed" and "tool bug" in results["c"].text
    assert results["u"].error == "unknown_tool" and "slow" in results["u"].text
    assert results["m"].error == "malformed" and "not valid JSON" in results["m"].text
    assert not any(r.ok for r in results.values())


def test_environment_text_is_capped_per_call():
    class Loud:
        name = "loud"

        def schema(self) -> dict:
            return {}

        def run(self, arguments: dict, time_limit_s: float) -> ToolOutput:
            return ToolOutput(text="y" * 10_000, ok=True)

    tokens = lambda s: len(s) // 4  # noqa: E731 - a stand-in tokenizer: four characters a token
    with ToolRunner(
        ToolRegistry([Loud()]), RunnerLimits(max_env_chars=1000, max_env_tokens=100), count_tokens=tokens
    ) as r:
        (res,) = r.run_all([call("loud")])
    assert (
        res.truncated
        and tokens(res.text) <= 100
        and len(res.text) > 300
        and "truncated" in res.text
        and res.ok
    )
    with pytest.raises(ValueError, match="count_tokens"):
        ToolRunner(ToolRegistry(), RunnerLimits(max_env_tokens=100))
    with pytest.raises(ValueError, match="max_workers"):
        RunnerLimits(max_workers=0)
    with pytest.raises(ValueError, match="time_limit_s"):
        RunnerLimits(time_limit_s=0)


# --- the Python tool and the code reward (real sandbox) ------------------------------------------------------


@pytest.fixture(scope="module")
def limits():
    base = tempfile.mkdtemp(prefix="rv-tools-test-")
    os.chmod(base, 0o711)
    yield SandboxLimits(cpu_seconds=5, wall_seconds=20, memory_bytes=256 * MIB, processes=16, base_dir=base)
    assert not os.listdir(base), "a call's folder was left behind"
    Path(base).rmdir()


@pytest.mark.system
def test_a_policy_turn_runs_in_the_python_tool_and_its_output_follows_the_turn(limits):
    reg = default_registry(limits)
    turn = (
        "I will use the interpreter.\n"
        + format_tool_call("code_interpreter", {"code": "print(sum(range(10)))"})
        + "\n"
        # idle, so only the wall limit stops it (a busy loop meets the 5 s CPU limit first on a quiet machine)
        + format_tool_call("python", {"code": "import time\nwhile True:\n    time.sleep(1)"})
        + "\n<tool_call>\n{broken\n</tool_call>"
    )
    with ToolRunner(reg, RunnerLimits(time_limit_s=6, grace_s=5, max_workers=3)) as runner:
        turn_result = runner.submit_turn(turn, turn_closed=False).result(timeout=60)
    ok, looped, broken = turn_result.results
    assert ok.ok and ok.text == "45"
    assert looped.error == "timeout" and "timed out after 6 s wall time" in looped.text
    assert broken.error == "malformed"
    assert turn_result.text == tool_response_text([ok.text, looped.text, broken.text], turn_closed=False)
    assert turn_result.text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n45\n</tool_response>")


@pytest.mark.system
def test_python_tool_refuses_bad_arguments_without_running(limits):
    tool = PythonTool(limits)
    assert tool.run({"code": 3}, 1).error == "bad_arguments"
    assert tool.run({"code": "1", "extra": 1}, 1).error == "bad_arguments"


HUMANEVAL_TEST = """
METADATA = {"author": "test"}


def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(2, 2) == 4
    for a in range(3):
        assert candidate(a, 0) == a
    assert candidate(-1, 1) == 0
"""


@pytest.mark.system
def test_humaneval_reward_all_pass_and_partial(limits):
    sandbox = Sandbox(limits)
    tests = CodeTests.humaneval(HUMANEVAL_TEST, "add")
    assert tests.n_cases == 4 and tests.judge is not None  # a loop: the judge runs the test code
    good = code_reward("def add(a, b):\n    return a + b\n", tests, sandbox)
    assert good.reward == 1.0 and good.passed == 4, good
    wrong_negative = (
        "def add(a, b):\n    if a < 0:\n        while True:\n            pass\n    return a + b\n"
    )
    all_pass = code_reward(wrong_negative, tests, sandbox, per_case_s=0.5)
    partial = code_reward(wrong_negative, tests, sandbox, partial=True, per_case_s=0.5)
    assert all_pass.reward == 0.0 and partial.reward == 0.75 and partial.passed == 3, partial
    assert "CaseTimeout" in partial.case_errors[3]
    sleeper = "import time\n\ndef add(a, b):\n    if a < 0:\n        time.sleep(600)\n    return a + b\n"
    slept = code_reward(sleeper, tests, sandbox, partial=True, per_case_s=0.5)
    assert slept.reward == 0.75 and "CaseTimeout" in slept.case_errors[3], slept  # the wall limit, 2.5 s


@pytest.mark.system
def test_mbpp_partial_credit_and_early_exit_gets_nothing(limits):
    sandbox = Sandbox(limits)
    tests = CodeTests.mbpp(["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(0) == 1"])
    partial = code_reward("def sq(x):\n    return x * x\n", tests, sandbox, partial=True)
    assert partial.reward == pytest.approx(2 / 3) and partial.case_errors[2].startswith("AssertionError")
    cheat = code_reward("import os\nos._exit(0)\n", tests, sandbox, partial=True)
    assert cheat.reward == 0.0 and "no test result" in cheat.reason
    with pytest.raises(ValueError, match="assert strings"):
        CodeTests.mbpp([])
    with pytest.raises(ValueError, match="check"):
        CodeTests.humaneval("def helper(): pass", "add")
