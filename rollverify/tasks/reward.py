"""A reward function named in the config (`task.reward: module:function`), as verl's custom reward path.

The spec is ``package.module:function`` (imported like any module, so it must be on ``sys.path``) or
``path/to/file.py:function`` (loaded from that file). The function is called as ``fn(prompt, response, label)``
with the prompt text, the decoded response and the label string, and returns a float (verl's ``compute_score``
takes the same three things under other names). It replaces the task's own reward for training and evaluation.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFn = Callable[[str, str, str], float]


class RewardSpecError(ValueError):
    """A `task.reward` spec that cannot be loaded; the message says which part and what to write instead."""


def _module_from_file(path: Path):
    name = f"rollverify_reward_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardSpecError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_reward(spec: str) -> RewardFn:
    """The function `spec` names, checked to take (prompt, response, label); a `RewardSpecError` otherwise."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise RewardSpecError(
            f"{spec!r} is not module:function; write e.g. my_rewards:score or path/to/rewards.py:score"
        )
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise RewardSpecError(f"{spec!r}: file {path} does not exist")
            module = _module_from_file(path)
        else:
            module = importlib.import_module(mod_name)
    except RewardSpecError:
        raise
    except ImportError as e:
        raise RewardSpecError(
            f"{spec!r}: cannot import module {mod_name!r} ({e}); put it on PYTHONPATH or give a file path"
        ) from None
    except Exception as e:
        raise RewardSpecError(f"{spec!r}: importing {mod_name!r} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardSpecError(
            f"{spec!r}: module {mod_name!r} has no {fn_name!r}; its functions: {', '.join(public) or 'none'}"
        )
    if not callable(fn):
        raise RewardSpecError(f"{spec!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("prompt", "response", "label")
    except TypeError:
        raise RewardSpecError(
            f"{spec!r}: {fn_name}{inspect.signature(fn)} cannot be called as {fn_name}(prompt, response, label)"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def checked_reward(fn: RewardFn, spec: str) -> RewardFn:
    """`fn` with its result checked: a finite number, else an error naming `spec` and the bad value."""

    def score(prompt: str, response: str, label: str) -> float:
        value = fn(prompt, response, label)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"task.reward {spec} returned {value!r}; it must return a finite number")
        return float(value)

    return score


def task_reward(task: Any, spec: str | None) -> RewardFn:
    """The reward a run scores with: `spec`'s function (checked) when given, else the task's own."""
    if spec is None:
        return task.reward
    return checked_reward(load_reward(spec), spec)
