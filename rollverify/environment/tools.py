"""Tools the policy can call, and the registry a task names them from.

A tool takes the call's arguments and a time limit and returns a `ToolOutput`; it raises only for a bug of its
own (the runner turns that into environment text too). The Python interpreter tool runs the code in a fresh
`Sandbox` with the call's time limit as its wall limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from rollverify.environment.limits import SandboxLimits
from rollverify.environment.sandbox import Sandbox, SandboxResult

TRUNCATION_MARKER = "\n...[truncated: {dropped} more characters]"


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns: the text the policy will see, and whether the tool call succeeded."""

    text: str
    ok: bool
    error: str | None = None
    details: Any = None


class Tool(Protocol):
    name: str

    def schema(self) -> dict[str, Any]:
        """The function description the chat template lists under `# Tools`."""
        ...

    def run(self, arguments: dict[str, Any], time_limit_s: float) -> ToolOutput: ...


class PythonTool:
    """A Python interpreter: `{"code": str}` runs in a fresh sandbox; stdout (and stderr, and how it ended when it
    did not exit 0) is the output."""

    def __init__(self, limits: SandboxLimits | None = None, name: str = "python") -> None:
        self.name = name
        self.sandbox = Sandbox(limits)

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Run Python code in a fresh interpreter and return what it prints.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The Python program to run."}},
                    "required": ["code"],
                },
            },
        }

    def run(self, arguments: dict[str, Any], time_limit_s: float) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput(
                text='error: the "code" argument must be a string of Python', ok=False, error="bad_arguments"
            )
        extra = set(arguments) - {"code"}
        if extra:
            return ToolOutput(
                text=f'error: unexpected arguments {sorted(extra)}; {self.name} takes only "code"',
                ok=False,
                error="bad_arguments",
            )
        limits = self.sandbox.limits
        if time_limit_s < limits.wall_seconds:
            sandbox = Sandbox(dataclasses.replace(limits, wall_seconds=time_limit_s))
        else:
            sandbox = self.sandbox
        result = sandbox.run(code)
        return ToolOutput(
            text=render_python_result(result),
            ok=result.ok,
            error=None if result.ok else "tool_error",
            details=result,
        )


def render_python_result(result: SandboxResult) -> str:
    """stdout, then stderr, then a line on how the program ended when it did not end well."""
    parts = [result.stdout]
    if result.stdout_truncated:
        parts.append(f"\n...[stdout truncated: {result.stdout_bytes} bytes printed]\n")
    if result.stderr:
        parts.append(result.stderr)
        if result.stderr_truncated:
            parts.append(f"\n...[stderr truncated: {result.stderr_bytes} bytes printed]\n")
    if not result.ok:
        parts.append(f"\n[{result.reason()}]")
    return "".join(parts).strip("\n") or "[no output]"


def truncate_text(
    text: str,
    max_chars: int | None,
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[str, bool]:
    """`text` cut to at most `max_chars` characters and `max_tokens` tokens (as `count_tokens` counts them), the
    marker included; whether it was cut."""
    if max_tokens is not None and count_tokens is None:
        raise ValueError("max_tokens needs count_tokens (the tokenizer's length of a text)")
    cut = False
    if max_chars is not None and len(text) > max_chars:
        text, cut = _cut(text, lambda s: len(s) <= max_chars), True
    if max_tokens is not None and count_tokens is not None and count_tokens(text) > max_tokens:
        text, cut = _cut(text, lambda s: count_tokens(s) <= max_tokens), True
    return text, cut


def _cut(text: str, fits: Callable[[str], bool]) -> str:
    """The longest head of `text` that, with the marker, fits (binary search over the head's length)."""

    def candidate(n: int) -> str:
        return text[:n] + TRUNCATION_MARKER.format(dropped=len(text) - n)

    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(candidate(mid)):
            lo = mid
        else:
            hi = mid - 1
    out = candidate(lo)
    if fits(out):
        return out
    # The limit is below the marker's own length: the bare word, or nothing.
    return "[truncated]" if fits("[truncated]") else ""


class ToolRegistry:
    """Tools by name (and alias), as a task configures them."""

    def __init__(self, tools: Iterable[Tool] = (), aliases: dict[str, str] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        self._aliases: dict[str, str] = {}
        for tool in tools:
            self.register(tool)
        for alias, target in (aliases or {}).items():
            self.alias(alias, target)

    def register(self, tool: Tool) -> None:
        if not getattr(tool, "name", None):
            raise ValueError(f"a tool needs a non-empty name; got {tool!r}")
        if tool.name in self._tools or tool.name in self._aliases:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        self._tools[tool.name] = tool

    def alias(self, alias: str, target: str) -> None:
        if target not in self._tools:
            raise ValueError(f"alias {alias!r} names {target!r}, which is not registered; register it first")
        if alias in self._tools or alias in self._aliases:
            raise ValueError(f"{alias!r} is a registered tool name already")
        self._aliases[alias] = target

    def get(self, name: str) -> Tool | None:
        return self._tools.get(self._aliases.get(name, name))

    def names(self) -> list[str]:
        return sorted(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [self._tools[n].schema() for n in self.names()]


def default_registry(limits: SandboxLimits | None = None) -> ToolRegistry:
    """The ReTool set: a Python interpreter named `python`, also answering to `code_interpreter`."""
    return ToolRegistry([PythonTool(limits)], aliases={"code_interpreter": "python"})
