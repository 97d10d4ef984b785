"""Named evaluation sets (`eval.sets`): prompt files in the project's layout, by name, beside the task's own
held-out split (`HELDOUT`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollverify.tasks.base import Example
from rollverify.tasks.data import load_prompt_file

HELDOUT = "heldout"
_SET_KEYS = ("path", "prompt_key", "label_key", "uid_key")
_SET_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True)
class EvalSetSpec:
    """One entry of `eval.sets`: a prompt file and the columns to read (see `load_prompt_file`)."""

    name: str
    path: str
    prompt_key: str = "prompt"
    label_key: str = "auto"
    uid_key: str | None = None


@dataclass(frozen=True)
class EvalSet:
    name: str
    examples: list[Example]


def parse_eval_sets(raw: dict[str, Any]) -> list[EvalSetSpec]:
    """`eval.sets` as specs: each value a file path or a mapping with `path` and optional column keys."""
    specs = []
    for name, value in raw.items():
        if not _SET_NAME.fullmatch(name):
            raise ValueError(f"set name {name!r}: use letters, digits, '_', '-' or '.' (it names metrics)")
        if name == HELDOUT:
            raise ValueError(f"set name {HELDOUT!r} is the task's held-out split; name the file otherwise")
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, dict) or not isinstance(value.get("path"), str):
            raise ValueError(f"{name}: expected a file path or a mapping with 'path', got {value!r}")
        unknown = sorted(set(value) - set(_SET_KEYS))
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_SET_KEYS)}")
        bad = [k for k, v in value.items() if not (isinstance(v, str) or (k == "uid_key" and v is None))]
        if bad:
            raise ValueError(f"{name}.{bad[0]}: expected a string, got {value[bad[0]]!r}")
        specs.append(EvalSetSpec(name=name, **value))
    return specs


def load_eval_sets(specs: Sequence[EvalSetSpec]) -> list[EvalSet]:
    out = []
    for s in specs:
        try:
            exs = load_prompt_file(
                Path(s.path).expanduser(), prompt_key=s.prompt_key, label_key=s.label_key, uid_key=s.uid_key
            )
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"{s.name}: {e}") from None
        out.append(EvalSet(s.name, exs))
    return out
