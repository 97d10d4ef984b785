"""Real prompt data: JSONL or parquet files of prompt + label, flat or in DAPO-Math / verl's nested layout.

DAPO-Math-17k rows look like ``{"prompt": [{"role": "user", "content": ...}], "reward_model": {"ground_truth":
"34", "style": ...}, "data_source": ..., "extra_info": {"index": ...}}``; flat files have ``prompt`` (a string)
and ``label``. Keys are configurable and may be dotted paths into nested columns.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rollverify.tasks.base import SPLITS, Example, TaskBase, check_split, hash_fraction, stable_uid
from rollverify.tasks.chat import ChatTemplate, check_chat_template
from rollverify.tasks.math import math_reward

LABEL_KEYS = ("label", "reward_model.ground_truth", "answer", "ground_truth")
SUFFIXES = (".jsonl", ".json", ".parquet")


def lookup(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, or a dotted path into nested dicts; KeyError when absent."""
    if key in row:
        return row[key]
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(key)
        cur = cur[part]
    return cur


def has_field(row: dict[str, Any], key: str) -> bool:
    """Whether `lookup(row, key)` finds a value."""
    try:
        lookup(row, key)
    except KeyError:
        return False
    return True


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL (one object a line) or parquet file, as plain dicts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON object per line ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")


def _columns(row: dict[str, Any]) -> str:
    names = []
    for k, v in row.items():
        names.append(k)
        if isinstance(v, dict):
            names += [f"{k}.{kk}" for kk in v]
    return ", ".join(names)


def _prompt_of(value: Any, where: str) -> tuple[str, tuple[dict[str, str], ...] | None]:
    """Plain text and (for chat data) the messages of one prompt cell."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: empty prompt")
        return value, None
    if (
        isinstance(value, (list, tuple))
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in value
        )
    ):
        msgs = tuple({"role": m["role"], "content": m["content"]} for m in value)
        return "\n\n".join(m["content"] for m in msgs), msgs
    raise ValueError(
        f"{where}: prompt must be a string or a non-empty list of {{role, content}} messages, "
        f"got {type(value).__name__}"
    )


def load_prompt_file(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    label_key: str = "auto",
    uid_key: str | None = None,
) -> list[Example]:
    """Examples of a prompt+label file.

    `label_key="auto"` takes the first of `LABEL_KEYS` present in the first row. `uid_key` names a column
    with stable ids; by default the uid hashes prompt and label, so it survives reordering of the file.
    """
    path = Path(path)
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    if label_key == "auto":
        found = [k for k in LABEL_KEYS if has_field(rows[0], k)]
        if not found:
            raise ValueError(
                f"{path}: no label column: tried {', '.join(LABEL_KEYS)}; columns: {_columns(rows[0])}; "
                "pass label_key= to name it"
            )
        label_key = found[0]
    out = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        for key, what in ((prompt_key, "prompt"), (label_key, "label")):
            if not has_field(row, key):
                raise ValueError(f"{where}: missing {what} column {key!r}; columns: {_columns(row)}")
        prompt, messages = _prompt_of(lookup(row, prompt_key), where)
        label = lookup(row, label_key)
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise ValueError(
                f"{where}: label {label_key!r} must be a string or number, got {type(label).__name__}"
            )
        label = str(label)
        if uid_key is not None:
            if not has_field(row, uid_key):
                raise ValueError(f"{where}: missing uid column {uid_key!r}; columns: {_columns(row)}")
            uid = str(lookup(row, uid_key))
        else:
            uid = stable_uid(prompt, label)
        meta = {k: v for k, v in row.items() if k not in (prompt_key, label_key.split(".")[0])}
        meta["row"] = i
        out.append(Example(uid=uid, prompt=prompt, label=label, meta=meta, messages=messages))
    return out


class FileTask(TaskBase):
    """Prompts from files with the math reward (DAPO-Math and similar).

    Without `eval_path`, a hashed `eval_fraction` of the train file is held out (disjoint, deterministic).
    """

    def __init__(
        self,
        train_path: str | Path,
        eval_path: str | Path | None = None,
        *,
        prompt_key: str = "prompt",
        label_key: str = "auto",
        uid_key: str | None = None,
        eval_fraction: float = 0.05,
        name: str = "math",
        chat_template: ChatTemplate = "auto",
    ) -> None:
        self.name = name
        self.chat_template = check_chat_template(chat_template)
        kw = dict(prompt_key=prompt_key, label_key=label_key, uid_key=uid_key)
        train = load_prompt_file(train_path, **kw)
        if eval_path is not None:
            self._splits = {"train": train, "eval": load_prompt_file(eval_path, **kw)}
        else:
            if not (0.0 < eval_fraction < 1.0):
                raise ValueError(
                    f"eval_fraction must be in (0, 1) when no eval_path is given; got {eval_fraction}"
                )
            held = [hash_fraction(e.uid, "file-split") < eval_fraction for e in train]
            self._splits = {
                "train": [e for e, h in zip(train, held, strict=True) if not h],
                "eval": [e for e, h in zip(train, held, strict=True) if h],
            }
        for split, exs in self._splits.items():
            if not exs:
                raise ValueError(f"{train_path}: the {split} split is empty; add rows or pass eval_path")

    def __len__(self) -> int:
        return len(self._splits["train"])

    def stream(self, split: str = "train", seed: int = 0) -> Iterator[Example]:
        """Train: shuffled epochs without end; eval: one shuffled pass."""
        check_split(split)
        exs = self._splits[split]
        for epoch in itertools.count() if split == "train" else (0,):
            order = np.random.default_rng([seed, SPLITS.index(split), epoch]).permutation(len(exs))
            for i in order:
                yield exs[int(i)]

    def all_examples(self, split: str, seed: int = 0) -> list[Example]:
        check_split(split)
        return list(itertools.islice(self.stream(split, seed), len(self._splits[split])))

    def reward(self, prompt: str, response: str, label: str) -> float:
        return math_reward(response, label)
