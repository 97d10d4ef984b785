"""Tasks: prompt sources with verifiable rewards, looked up by name.

`get_task("countdown")` is the synthetic long-tailed task the CPU default trains on; `get_task("math",
train_path=...)` serves real prompt+label files (DAPO-Math layout or flat) with the boxed/``Answer:`` math
reward. `register_task` adds a factory under a new name.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from rollverify.tasks.base import SPLITS, Example, Task, TaskBase, hash_fraction, stable_uid
from rollverify.tasks.code import CodeTask
from rollverify.tasks.count import CountdownTask
from rollverify.tasks.data import FileTask, load_prompt_file
from rollverify.tasks.math import extract_answer, math_equal, math_reward, normalize_answer
from rollverify.tasks.retool import RetoolTask
from rollverify.tasks.toolchain import ToolChainTask

_REGISTRY: dict[str, Callable[..., Task]] = {}
_SYNTHETIC: set[str] = set()


def register_task(
    name: str, factory: Callable[..., Task], *, synthetic: bool = False, replace: bool = False
) -> None:
    """Make `get_task(name, **kwargs)` call `factory(**kwargs)`.

    `synthetic` tasks generate their own prompts and have `demonstration(example)`, so a tiny model can be
    warm-started on them.
    """
    if name in _REGISTRY and not replace:
        raise ValueError(f"task {name!r} is already registered")
    _REGISTRY[name] = factory
    _SYNTHETIC.discard(name)
    if synthetic:
        _SYNTHETIC.add(name)


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def synthetic_task_names() -> list[str]:
    return sorted(_SYNTHETIC)


def task_options(name: str) -> list[str] | None:
    """The keyword options the factory of task `name` takes (None: it takes any)."""
    params = inspect.signature(_REGISTRY[name]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def get_task(name: str, **kwargs: Any) -> Task:
    """The task registered as `name`, built with `kwargs` (a clear error for unknown names or options)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(task_names())}")
    allowed = task_options(name)
    for key in kwargs if allowed is not None else ():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"task {name!r} has no option {key!r}{hint}; its options: {', '.join(allowed)}")
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"task {name!r}: bad options {sorted(kwargs)}: {e}") from e


register_task("countdown", CountdownTask, synthetic=True)
# Same task with at most 16 terms (responses <= 70 tokens): for engine and loop tests that must be quick.
register_task("countdown_short", functools.partial(CountdownTask, name="countdown_short", k_max=16), synthetic=True)
register_task("math", FileTask)
# The multi-turn tool task: walk a hidden chain with the `next` tool, one call per turn (long-tailed turns).
register_task("toolchain", ToolChainTask, synthetic=True)
# ReTool-style math: prompt files with the sandboxed Python tool (code interpreter) and the math reward.
register_task("retool", RetoolTask)
# Code generation: HumanEval / MBPP / LiveCodeBench files (tools/prepare_data.py), rewarded by their tests.
register_task("code", CodeTask)

__all__ = [
    "SPLITS",
    "CodeTask",
    "CountdownTask",
    "Example",
    "FileTask",
    "Task",
    "RetoolTask",
    "TaskBase",
    "ToolChainTask",
    "extract_answer",
    "get_task",
    "hash_fraction",
    "load_prompt_file",
    "math_equal",
    "math_reward",
    "normalize_answer",
    "register_task",
    "stable_uid",
    "synthetic_task_names",
    "task_names",
]
