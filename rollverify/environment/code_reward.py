"""Reward for code generation: the candidate runs in one sandbox, its tests are decided outside it.

`code_reward` starts the candidate's sandbox (the box: `_code_box.py`) with the program alone, then asks it, one
test case at a time, for what the program produces: the return value of a call with the case's arguments, or
what it prints on the case's input. Answers come back as plain values through the box's message channel; the
caller validates each (its id, its shape, its size) and a box that answers out of turn or breaks the channel gets
no further case. The expected values and the test code never enter the box. Checks (`code_tests.Check`) and stdio
cases are compared here; test code (`code_tests.JudgeSpec`) runs in a second sandbox, the judge, with no candidate
code in it, and the judge's verdicts are the cases'. See `code_tests` for why no candidate can forge a pass.

The reward is 1.0 when every case passes, else 0.0; with `partial=True` the fraction that passed. Each case runs in
a process of its own in the box, under `per_case_s` of CPU and five times that of wall time, so a loaded machine
does not fail a correct case and one looping, sleeping or exiting case loses no other; the sandbox's limits bound
the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollverify.environment.code_tests import Check, CodeTests, JudgeSpec
from rollverify.environment.sandbox import Sandbox, SandboxResult, SandboxStartError
from rollverify.environment.session import ChannelError, SandboxSession
from rollverify.environment.wire import WireError, decode, encode

_HERE = Path(__file__).parent
WIRE = {"wire.py": (_HERE / "wire.py").read_text()}
BOX_SOURCE = (_HERE / "_code_box.py").read_text()
JUDGE_SOURCE = (_HERE / "_code_judge.py").read_text()
WALL_FACTOR = 5
# Beyond a case's own wall budget, how long the caller waits for an answer before it gives the box up.
REPLY_GRACE_S = 3.0
MAX_MESSAGE = 16 << 20
MAX_OUTPUT = 8 << 20

__all__ = ["Check", "CodeReward", "CodeTests", "JudgeSpec", "code_reward"]


@dataclass(frozen=True)
class CodeReward:
    reward: float
    passed: int
    total: int
    reason: str
    case_errors: tuple[str | None, ...] = ()
    sandbox: SandboxResult | None = field(default=None, repr=False)
    judge: SandboxResult | None = field(default=None, repr=False)


class _Box:
    """The candidate's sandbox as the trusted side sees it: every answer checked for its id and shape."""

    def __init__(self, session: SandboxSession, per_case_s: float) -> None:
        self.session = session
        self.timeout = WALL_FACTOR * per_case_s + REPLY_GRACE_S
        self.next_id = 0
        self.broken: str | None = None

    def ready(self, timeout_s: float) -> str | None:
        """None when the program loaded, else why not (its error, or how the box failed to answer)."""
        reply = self._receive(timeout_s)
        if reply is None:
            return self.broken
        if set(reply) != {"ready", "error"} or reply["ready"] is not True:
            return self._break("the box answered out of turn")
        return None if reply["error"] is None else f"the program did not load: {str(reply['error'])[:500]}"

    def case(self, index: int) -> None:
        if self.broken is None and not self.session.send({"case": index}, self.timeout):
            self._break("the box stopped reading")

    def post(self, request: dict[str, Any]) -> int:
        """Send one request without waiting for its answer (the box answers in order); its id."""
        rid = self.next_id
        self.next_id += 1
        if self.broken is None and not self.session.send({"id": rid, **request}, self.timeout):
            self._break("the box stopped reading")
        return rid

    def answer(self, rid: int) -> dict[str, Any] | None:
        """The box's next answer, which must be to request `rid`; None (and `broken`) when it has none."""
        if self.broken is not None:
            return None
        reply = self._receive(self.timeout)
        if reply is not None and reply.get("id") != rid:
            self._break("the box answered out of turn")
            return None
        return reply

    def call(self, name: str, method: str | None, args: Any, kwargs: Any) -> tuple[Any, str | None, str | None]:
        """(value, None, None) or (None, error, error type) of one call of the candidate."""
        return self.value(self.answer(self.post(self.call_request(name, method, args, kwargs))))

    @staticmethod
    def call_request(name: str, method: str | None, args: Any, kwargs: Any) -> dict[str, Any]:
        return {"call": name, "method": method, "args": args, "kwargs": kwargs}

    def value(self, reply: dict[str, Any] | None) -> tuple[Any, str | None, str | None]:
        """A call's answer read: (value, None, None) or (None, error, error type)."""
        if reply is None:
            return None, f"no answer: {self.broken}", "BoxError"
        try:
            if set(reply) == {"id", "value"}:
                return decode(reply["value"]), None, None
            if set(reply) == {"id", "error", "type"} and isinstance(reply["error"], str):
                return None, reply["error"][:500], str(reply["type"])[:100]
        except WireError as exc:
            self._break(f"the box sent a value that is not plain data: {exc}")
            return None, f"no answer: {self.broken}", "BoxError"
        self._break("the box sent a malformed answer")
        return None, f"no answer: {self.broken}", "BoxError"

    def stdout(self, reply: dict[str, Any] | None) -> tuple[str | None, str | None]:
        """A stdin run's answer read: (stdout, None), or (None, why not)."""
        if reply is None:
            return None, f"no answer: {self.broken}"
        if set(reply) == {"id", "stdout", "exit", "truncated"} and isinstance(reply["stdout"], str):
            if reply["truncated"] is True:
                return None, f"the program printed more than {MAX_OUTPUT} bytes"
            return reply["stdout"], None
        if set(reply) == {"id", "error", "type"} and isinstance(reply["error"], str):
            return None, reply["error"][:500]
        self._break("the box sent a malformed answer")
        return None, f"no answer: {self.broken}"

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            reply = self.session.recv(timeout_s)
        except ChannelError as exc:
            self._break(f"the box broke its channel: {exc}")
            return None
        if reply is None:
            self._break("the box ended or stopped answering")
        return reply

    def _break(self, why: str) -> str:
        if self.broken is None:
            self.broken = why
            self.session.kill()
        return why


def code_reward(
    program: str, tests: CodeTests, sandbox: Sandbox, *, partial: bool = False, per_case_s: float = 2.0
) -> CodeReward:
    """Run `program` in `sandbox` and decide `tests` outside it; 1/0 all-pass, or the fraction passed."""
    if per_case_s <= 0:
        raise ValueError(f"per_case_s must be positive; got {per_case_s!r}")
    total = tests.n_cases
    try:
        session = sandbox.start(BOX_SOURCE, files=WIRE, max_message_bytes=MAX_MESSAGE)
    except SandboxStartError as exc:
        return CodeReward(0.0, 0, total, f"no test result: {exc}")
    judge_session: SandboxSession | None = None
    box = _Box(session, per_case_s)
    passed = [False] * total
    errors: list[str | None] = [None] * total
    setup_error: str | None = None
    try:
        if tests.judge is not None:
            try:
                judge_session = sandbox.start(JUDGE_SOURCE, files=WIRE, max_message_bytes=MAX_MESSAGE)
            except SandboxStartError as exc:
                return _finish(box, None, 0.0, 0, total, f"no test result: the judge did not start: {exc}", ())
        mode = "stdio" if tests.stdio else "call"
        box.session.send({"mode": mode, "program": program, "per_case_s": per_case_s, "wall_factor": WALL_FACTOR,
                          "max_frame": MAX_MESSAGE, "max_output": MAX_OUTPUT})
        load_error = box.ready(WALL_FACTOR * per_case_s + REPLY_GRACE_S + sandbox.limits.wall_seconds / 4)
        if load_error is not None and box.broken is not None:
            return _finish(box, judge_session, 0.0, 0, total, f"no test result: {load_error}", ())
        if tests.judge is not None and judge_session is not None:
            setup_error = _run_judged(box, judge_session, tests.judge, per_case_s, passed, errors)
        elif tests.stdio:
            _run_stdio(box, tests.stdio, passed, errors)
        else:
            _run_checks(box, tests.checks, passed, errors)
        setup_error = setup_error or load_error
    except BaseException:
        for s in (session, judge_session):
            if s is not None:
                s.finish(kill=True)
        raise
    n = sum(passed)
    reason = f"{n}/{total} test cases passed" + (f"; {setup_error}" if setup_error else "")
    if box.broken is not None:
        reason += f"; {box.broken}"
    if partial:
        reward = n / total
    else:
        reward = 1.0 if n == total and setup_error is None else 0.0
    return _finish(box, judge_session, reward, n, total, reason, tuple(errors))


def _finish(
    box: _Box, judge: SandboxSession | None, reward: float, n: int, total: int, reason: str,
    errors: tuple[str | None, ...],
) -> CodeReward:
    result = box.session.finish()
    judged = judge.finish() if judge is not None else None
    if box.broken is None and not result.ok and result.error is None:
        reason += f"; {result.reason()}"
    return CodeReward(reward, n, total, reason, errors or (None,) * total, sandbox=result, judge=judged)


def _run_checks(box: _Box, checks: tuple[Check, ...], passed: list[bool], errors: list[str | None]) -> None:
    """Every call is sent at once (the box answers in order, one case process after another), then read."""
    posted = []
    for i, check in enumerate(checks):
        if check.call is None:
            passed[i] = check.holds(None)
            errors[i] = None if passed[i] else "AssertionError: the test asserts a false constant"
            continue
        box.case(i)
        request = box.call_request(check.call, check.method, encode(list(check.args)), encode(check.kwargs))
        posted.append((i, check, box.post(request)))
    for i, check, rid in posted:
        value, error, _ = box.value(box.answer(rid))
        if error is not None:
            errors[i] = error
        elif check.holds(value):
            passed[i] = True
        else:
            errors[i] = f"AssertionError: {_called(check)} returned {_short(value)}; the test wants " + (
                check.op if check.op in ("truthy", "falsy") else f"{check.op} {_short(check.expected)}")


def _called(check: Check) -> str:
    return f"{check.call}().{check.method}(...)" if check.method else f"{check.call}(...)"


def _run_stdio(box: _Box, cases: tuple[tuple[str, str], ...], passed: list[bool], errors: list[str | None]) -> None:
    """Every input is sent at once (the box runs the program on each in turn), then each output compared."""
    posted = []
    for i, (stdin, expected) in enumerate(cases):
        box.case(i)
        posted.append((i, expected, box.post({"stdin": stdin})))
    for i, expected, rid in posted:
        out, error = box.stdout(box.answer(rid))
        if out is None:
            errors[i] = error
            continue
        got = [line.strip() for line in out.strip().splitlines()]
        want = [line.strip() for line in expected.strip().splitlines()]
        passed[i] = got == want
        if not passed[i]:
            errors[i] = f"AssertionError: printed {_short(got[:3])}, expected {_short(want[:3])}"


def _run_judged(
    box: _Box, judge: SandboxSession, spec: JudgeSpec, per_case_s: float, passed: list[bool],
    errors: list[str | None],
) -> str | None:
    """Relay the judge's calls of the candidate to the box until the judge is done; its setup error, if any."""
    judge.send({"prompt": spec.prompt, "setup": spec.setup, "cases": list(spec.cases), "call": spec.call,
                "remote": list(spec.remote), "per_case_s": per_case_s, "max_frame": MAX_MESSAGE})
    timeout = WALL_FACTOR * per_case_s + REPLY_GRACE_S
    seen: set[int] = set()
    total = len(passed)
    while True:
        try:
            msg = judge.recv(timeout)
        except ChannelError as exc:
            return f"the judge broke its channel: {exc}"
        if msg is None:
            return "the judge ended before it was done"
        if "case" in msg and isinstance(msg["case"], int):
            box.case(msg["case"])
        elif "call" in msg and "id" in msg:
            value, error, kind = box.call(str(msg["call"]), None, msg.get("args", []), msg.get("kwargs", {}))
            reply: dict[str, Any]
            try:
                reply = {"id": msg["id"], "value": encode(value)} if error is None else \
                    {"id": msg["id"], "error": error, "type": kind}
            except WireError as exc:
                reply = {"id": msg["id"], "error": str(exc), "type": "TypeError"}
            if not judge.send(reply, timeout):
                return "the judge stopped reading"
        elif "verdict" in msg and isinstance(msg["verdict"], int) and 0 <= msg["verdict"] < total:
            i = msg["verdict"]
            if i not in seen:
                seen.add(i)
                passed[i] = msg.get("passed") is True
                errors[i] = None if passed[i] else str(msg.get("error"))[:500]
        elif msg.get("done") is True:
            for i in range(total):
                if i not in seen:
                    errors[i] = "the test code never reached this case"
            err = msg.get("setup_error")
            return None if err is None else f"the test code failed: {str(err)[:500]}"
        else:
            return "the judge sent a malformed message"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
