"""Reward for code generation: run a candidate program and its tests in the sandbox.

Tests come in the two published shapes: HumanEval (`test` defines `check(candidate)`, called on the
`entry_point` function) and MBPP (a list of assert statements, with optional setup code). Each test case runs in
its own try, so one failure or one exception hides no other: for MBPP a case is one assert string, for HumanEval
each top-level statement of `check`'s body that holds an assert. The reward is 1.0 when every case passes, else
0.0; with `partial=True` it is the fraction that passed. A per-case limit (interval timers inside the program:
`per_case_s` of CPU, five times that of wall time, so a loaded machine does not fail a correct case) stops one
looping or sleeping case without losing the others; the sandbox's limits bound the whole run.

The harness writes its counts to a result file with a per-call nonce, so a candidate that exits early
(`sys.exit(0)`, `os._exit(0)`) or prints a forged result gets no credit. It is not proof against a candidate that
inspects the harness's own frames or patches its builtins: the program and its tests share one interpreter.
"""

from __future__ import annotations

import ast
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollverify.environment.sandbox import Sandbox, SandboxResult

RESULT_FILE = "rv_result.json"
CASE_HOOK = "__rv_case__"

HARNESS = r"""
import json, os, signal, sys

WALL_FACTOR = 5

def __rv_main__():
    with open("rv_spec.json") as f:
        spec = json.load(f)
    os.remove("rv_spec.json")
    nonce, cases, per_case = spec["nonce"], spec["cases"], spec["per_case_s"]
    outcome = {"passed": [False] * len(cases), "errors": [None] * len(cases), "setup_error": None}

    class CaseTimeout(Exception):
        pass

    def on_timer(signum, frame):
        raise CaseTimeout(f"test case ran past {per_case} s of CPU ({WALL_FACTOR * per_case} s wall)")

    signal.signal(signal.SIGPROF, on_timer)
    signal.signal(signal.SIGALRM, on_timer)

    def arm(seconds):
        signal.setitimer(signal.ITIMER_PROF, seconds)
        signal.setitimer(signal.ITIMER_REAL, WALL_FACTOR * seconds)

    def run_case(i, fn):
        arm(per_case)
        try:
            fn()
        except BaseException as exc:
            outcome["errors"][i] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            outcome["passed"][i] = True
        finally:
            arm(0)

    ns = {"__name__": "__main__", "__rv_case__": run_case}
    try:
        arm(per_case)
        exec(compile(spec["program"], "solution.py", "exec"), ns)
        exec(compile(spec["setup"], "tests_setup.py", "exec"), ns)
        arm(0)
        for i, src in enumerate(cases):
            if src is not None:
                run_case(i, lambda src=src: exec(compile(src, f"test_{i}.py", "exec"), ns))
        if spec["call"] is not None:
            exec(compile(spec["call"], "tests_call.py", "exec"), ns)
    except BaseException as exc:
        outcome["setup_error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        arm(0)
    with open("rv_result.json", "w") as f:
        json.dump({"nonce": nonce, **outcome}, f)

__rv_main__()
os._exit(0)
"""


STDIO_SETUP = r"""
import io as __rv_io, sys as __rv_sys

def __rv_stdio__(inp, expected):
    out = __rv_io.StringIO()
    saved = __rv_sys.stdin, __rv_sys.stdout
    __rv_sys.stdin, __rv_sys.stdout = __rv_io.StringIO(inp), out
    try:
        exec(compile(__rv_src__, "solution.py", "exec"), {"__name__": "__main__"})
    except SystemExit:
        pass
    finally:
        __rv_sys.stdin, __rv_sys.stdout = saved
    got = [line.strip() for line in out.getvalue().strip().splitlines()]
    want = [line.strip() for line in expected.strip().splitlines()]
    assert got == want, f"expected {want[:3]}, printed {got[:3]}"
"""


@dataclass(frozen=True)
class CodeTests:
    """One problem's tests: `cases` are run one by one (each None case is filled in by `call`, HumanEval's
    `check(entry_point)`, through the case hook); `setup` runs after the program and before the cases.
    `stdin_program`: the program is a script reading standard input (LiveCodeBench's stdin tests): it is not run
    on its own, each case runs it afresh on its input and compares what it prints."""

    cases: tuple[str | None, ...]
    setup: str = ""
    call: str | None = None
    stdin_program: bool = False

    @classmethod
    def stdio(cls, cases: Sequence[tuple[str, str]]) -> CodeTests:
        """Input/expected-output pairs: the program's printed lines (stripped) must equal the expected ones."""
        if not cases:
            raise ValueError("stdin tests need at least one (input, output) pair")
        return cls(cases=tuple(f"__rv_stdio__({i!r}, {o!r})" for i, o in cases), setup=STDIO_SETUP,
                   stdin_program=True)

    @classmethod
    def functional(cls, func_name: str, cases: Sequence[tuple[str, str]]) -> CodeTests:
        """LiveCodeBench's functional tests: each input line a JSON argument of `Solution().func_name`, the
        output the JSON of its result."""
        if not func_name.isidentifier() or not cases:
            raise ValueError(f"functional tests need a method name and cases; got {func_name!r}, {len(cases)}")
        calls = tuple(
            f"assert Solution().{func_name}(*[__rv_json.loads(a) for a in {i!r}.strip().split(chr(10))]) "
            f"== __rv_json.loads({o!r})" for i, o in cases
        )
        return cls(cases=calls, setup="import json as __rv_json")

    @classmethod
    def mbpp(cls, test_list: Sequence[str], test_setup_code: str = "") -> CodeTests:
        if not test_list or not all(isinstance(t, str) and t.strip() for t in test_list):
            raise ValueError(f"MBPP tests need a non-empty list of assert strings; got {test_list!r}")
        return cls(cases=tuple(test_list), setup=test_setup_code or "")

    @classmethod
    def humaneval(cls, test: str, entry_point: str) -> CodeTests:
        """`test` defines `check(candidate)`; each top-level statement of its body that holds an assert is a case."""
        if not entry_point.isidentifier():
            raise ValueError(f"HumanEval entry_point must be a function name; got {entry_point!r}")
        try:
            tree = ast.parse(test)
        except SyntaxError as exc:
            raise ValueError(f"HumanEval test code does not parse: {exc}") from None
        check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
        if check is None:
            raise ValueError("HumanEval test code defines no check(candidate) function")
        n_cases = 0
        body: list[ast.stmt] = []
        for stmt in check.body:
            if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                body.extend(_as_case(stmt, n_cases))
                n_cases += 1
            else:
                body.append(stmt)
        if n_cases == 0:
            raise ValueError("HumanEval check() holds no assert: there is nothing to reward")
        check.body = body
        setup = ast.unparse(ast.fix_missing_locations(tree))
        return cls(cases=(None,) * n_cases, setup=setup, call=f"check({entry_point})")


def _as_case(stmt: ast.stmt, index: int) -> list[ast.stmt]:
    """`stmt` as a local function and `__rv_case__(index, that function)`: a closure, so check's locals are seen."""
    fn = ast.FunctionDef(
        name=f"__rv_case_{index}__",
        args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[stmt],
        decorator_list=[],
        returns=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}),
    )
    call = ast.Expr(
        ast.Call(ast.Name(CASE_HOOK, ast.Load()), [ast.Constant(index), ast.Name(fn.name, ast.Load())], [])
    )
    return [ast.copy_location(fn, stmt), ast.copy_location(call, stmt)]


@dataclass(frozen=True)
class CodeReward:
    reward: float
    passed: int
    total: int
    reason: str
    case_errors: tuple[str | None, ...] = ()
    sandbox: SandboxResult | None = field(default=None, repr=False)


def code_reward(
    program: str, tests: CodeTests, sandbox: Sandbox, *, partial: bool = False, per_case_s: float = 2.0
) -> CodeReward:
    """Run `program` and `tests` in `sandbox`; 1/0 all-pass, or the fraction passed when `partial`."""
    if per_case_s <= 0:
        raise ValueError(f"per_case_s must be positive; got {per_case_s!r}")
    total = len(tests.cases)
    nonce = secrets.token_hex(16)
    spec: dict[str, Any] = {
        "nonce": nonce,
        "program": f"__rv_src__ = {program!r}" if tests.stdin_program else program,
        "setup": tests.setup,
        "cases": list(tests.cases),
        "call": tests.call,
        "per_case_s": per_case_s,
    }
    run = sandbox.run(HARNESS, files={"rv_spec.json": json.dumps(spec)}, collect=(RESULT_FILE,))
    raw = run.files.get(RESULT_FILE)
    try:
        outcome = json.loads(raw) if raw else None
    except ValueError:
        outcome = None
    if not isinstance(outcome, dict) or outcome.get("nonce") != nonce:
        why = run.reason() if not run.ok else "the program ended before the tests reported (early exit?)"
        return CodeReward(0.0, 0, total, f"no test result: {why}", sandbox=run)
    flags = outcome.get("passed", [])
    passed = sum(1 for p in flags if p is True) if len(flags) == total else 0
    errors = tuple(outcome.get("errors", [None] * total))
    setup_error = outcome.get("setup_error")
    reason = f"{passed}/{total} test cases passed" + (f"; {setup_error}" if setup_error else "")
    if not run.ok:
        reason += f"; {run.reason()}"
    if partial:
        reward = passed / total
    else:
        reward = 1.0 if passed == total and setup_error is None else 0.0
    return CodeReward(reward, passed, total, reason, case_errors=errors, sandbox=run)
