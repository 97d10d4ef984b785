"""A code problem's tests, in the form the trusted side decides them.

Every test case is decided outside the sandbox that runs the candidate, from plain values the candidate produced
(`wire`); the expected values never enter that sandbox. A case takes one of three forms:

- a `Check`: one call of the candidate with literal arguments and a literal expectation (`assert f(1, [2]) ==
  (3, 4)`, `assert not f(0)`, LiveCodeBench's functional tests): the caller compares the returned value itself,
  with no test code run at all;
- a stdin/stdout pair (LiveCodeBench's stdin tests): the candidate runs on the input in a process of its own and
  the caller compares the printed lines;
- a judged case, for tests that are code rather than data (HumanEval's `check(candidate)` with loops, helpers and
  random inputs; MBPP asserts that compute their expectations): the test code runs in a judge sandbox of its own,
  where every call of the candidate returns the plain value the candidate's sandbox produced, and the judge's
  verdict is the case's. No candidate code runs in the judge.

So a candidate cannot reach the verdict: not by walking the frames of the code that tests it, patching its
builtins or helpers, returning an object that claims equality, or writing to a result channel. A value that is
not plain data (an instance of the candidate's class, a generator) fails its case.
"""

from __future__ import annotations

import ast
import builtins
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CASE_HOOK = "__rv_case__"
OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not"}


@dataclass(frozen=True)
class Check:
    """`call(*args, **kwargs)` (or `call().method(...)`) of the candidate, held to `op` against `expected`:
    "==", "!=", "is", "is not", "truthy", "falsy"; "const" is a case that holds no call (`assert True`)."""

    call: str | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    op: str = "=="
    expected: Any = None
    method: str | None = None
    tuple_as_list: bool = False

    def holds(self, got: Any) -> bool:
        """Whether the candidate's plain value `got` passes; built-in types only, so equality is Python's own."""
        if self.tuple_as_list and isinstance(got, tuple):
            got = list(got)
        if self.op == "==":
            return bool(got == self.expected)
        if self.op == "!=":
            return bool(got != self.expected)
        if self.op == "is":
            return got is self.expected
        if self.op == "is not":
            return got is not self.expected
        if self.op == "truthy":
            return bool(got)
        if self.op == "falsy":
            return not got
        return bool(self.expected)


@dataclass(frozen=True)
class JudgeSpec:
    """Test code for the judge: `prompt` (trusted helpers, run first), `remote` (names that stand for the
    candidate's functions), `setup`, then `cases` (sources; None: reached through the case hook by `call`)."""

    setup: str
    cases: tuple[str | None, ...]
    remote: tuple[str, ...]
    call: str | None = None
    prompt: str = ""


@dataclass(frozen=True)
class CodeTests:
    """One problem's tests: exactly one of `checks`, `stdio` or `judge` is set. `stdin_program`: the program is a
    script reading standard input, run afresh per case."""

    checks: tuple[Check, ...] = ()
    stdio: tuple[tuple[str, str], ...] = ()
    judge: JudgeSpec | None = None

    @property
    def n_cases(self) -> int:
        if self.judge is not None:
            return len(self.judge.cases)
        return len(self.checks) or len(self.stdio)

    @property
    def stdin_program(self) -> bool:
        return bool(self.stdio)

    @classmethod
    def stdio_pairs(cls, cases: Sequence[tuple[str, str]]) -> CodeTests:
        """Input/expected-output pairs: the program's printed lines (stripped) must equal the expected ones."""
        if not cases:
            raise ValueError("stdin tests need at least one (input, output) pair")
        return cls(stdio=tuple((str(i), str(o)) for i, o in cases))

    @classmethod
    def functional(cls, func_name: str, cases: Sequence[tuple[str, str]]) -> CodeTests:
        """LiveCodeBench's functional tests: each input line a JSON argument of `Solution().func_name`, the
        output the JSON of its result (a returned tuple counts as a list, as LiveCodeBench counts it)."""
        if not func_name.isidentifier() or not cases:
            raise ValueError(f"functional tests need a method name and cases; got {func_name!r}, {len(cases)}")
        checks = []
        for i, o in cases:
            try:
                args = tuple(json.loads(a) for a in str(i).strip().split("\n"))
                expected = json.loads(o)
            except ValueError as exc:
                raise ValueError(f"a functional test case is not JSON: {exc}") from None
            checks.append(Check("Solution", args, method=func_name, expected=expected, tuple_as_list=True))
        return cls(checks=tuple(checks))

    @classmethod
    def mbpp(cls, test_list: Sequence[str], test_setup_code: str = "") -> CodeTests:
        """Each assert string a case: a `Check` when all are literal calls, else the judge runs them."""
        if not test_list or not all(isinstance(t, str) and t.strip() for t in test_list):
            raise ValueError(f"MBPP tests need a non-empty list of assert strings; got {test_list!r}")
        setup = test_setup_code or ""
        try:
            trees = [ast.parse(t) for t in test_list]
            bound = _bound_names(ast.parse(setup))
        except SyntaxError as exc:
            raise ValueError(f"MBPP test code does not parse: {exc}") from None
        checks = [_literal_check(t.body[0], None) if len(t.body) == 1 else None for t in trees]
        if all(c is not None for c in checks) and not {c.call for c in checks if c} & bound:  # type: ignore[union-attr]
            return cls(checks=tuple(checks))  # type: ignore[arg-type]
        remote = sorted(set().union(*(_free_names(t) for t in trees)) - bound - set(dir(builtins)))
        return cls(judge=JudgeSpec(setup=setup, cases=tuple(test_list), remote=tuple(remote)))

    @classmethod
    def humaneval(cls, test: str, entry_point: str, prompt: str = "") -> CodeTests:
        """`test` defines `check(candidate)`; each top-level statement of its body that holds an assert is a case.
        `prompt` (the problem's signature and helpers) is what the test code may use besides the candidate."""
        if not entry_point.isidentifier():
            raise ValueError(f"HumanEval entry_point must be a function name; got {entry_point!r}")
        try:
            tree = ast.parse(test)
        except SyntaxError as exc:
            raise ValueError(f"HumanEval test code does not parse: {exc}") from None
        check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
        if check is None:
            raise ValueError("HumanEval test code defines no check(candidate) function")
        param = check.args.args[0].arg if check.args.args else "candidate"
        literal: list[Check] | None = []
        n_cases = 0
        body: list[ast.stmt] = []
        for stmt in check.body:
            if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                body.extend(_as_case(stmt, n_cases))
                n_cases += 1
                found = _literal_check(stmt, (param, entry_point))
                literal = literal + [found] if literal is not None and found is not None else None
            else:
                body.append(stmt)
                if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                    literal = None  # a statement the cases may depend on: the judge runs the whole check
        if n_cases == 0:
            raise ValueError("HumanEval check() holds no assert: there is nothing to reward")
        if literal is not None:
            return cls(checks=tuple(literal))
        check.body = body
        setup = ast.unparse(ast.fix_missing_locations(tree))
        return cls(judge=JudgeSpec(setup=setup, cases=(None,) * n_cases, remote=(entry_point,),
                                   call=f"check({entry_point})", prompt=prompt))


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


def _literal_check(stmt: ast.stmt, candidate: tuple[str, str] | None) -> Check | None:
    """The `Check` an assert statement is, when it is one call with literal arguments against a literal; else None.
    `candidate`: (the name the test calls, the function it stands for), or None for any function name."""
    if not isinstance(stmt, ast.Assert):
        return None
    test = stmt.test
    try:
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in OPS:
            op = OPS[type(test.ops[0])]
            for call_side, other in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
                found = _literal_call(call_side, candidate)
                if found is not None:
                    expected = ast.literal_eval(other)
                    if op in ("is", "is not") and expected not in (None, True, False):
                        return None
                    return Check(found[0], found[1], found[2], op, expected)
            return None
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        found = _literal_call(test.operand if negated else test, candidate)  # type: ignore[attr-defined]
        if found is not None:
            return Check(found[0], found[1], found[2], "falsy" if negated else "truthy")
        return Check(None, op="const", expected=ast.literal_eval(test))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _literal_call(node: ast.AST, candidate: tuple[str, str] | None) -> tuple[str, tuple, dict] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    name = node.func.id
    if candidate is not None:
        if name != candidate[0]:
            return None
        name = candidate[1]
    elif hasattr(builtins, name):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    try:
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return name, args, kwargs


def _bound_names(tree: ast.AST) -> set[str]:
    """Names a setup module binds at its top level (assignments, defs, classes, imports)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _free_names(tree: ast.AST) -> set[str]:
    """Names a test reads that it does not bind itself."""
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loads - _bound_names(tree)
