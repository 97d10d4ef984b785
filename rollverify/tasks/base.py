"""The task interface: prompts with labels, and a verifiable reward.

A task is everything the loop needs to know about the problem being learnt: where prompts come from (a train
stream, a fixed held-out eval split) and how a response is scored. It knows nothing of models or engines.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Example:
    """One prompt: text the model continues, the label the reward checks against, free-form metadata.

    `messages` holds the chat form when the source had one (real data); `prompt` is then the plain rendering,
    used by models without a chat template. `uid` is stable across runs, so groups and resumes can name prompts.
    """

    uid: str
    prompt: str
    label: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    messages: tuple[dict[str, str], ...] | None = None


@runtime_checkable
class Task(Protocol):
    """What the loop needs from a task."""

    name: str

    def stream(self, split: str = "train", seed: int = 0) -> Iterator[Example]:
        """Prompts in a deterministic order for `seed`; the train stream never ends."""
        ...

    def examples(self, split: str, n: int | None = None, seed: int = 0) -> list[Example]:
        """The first `n` prompts of `stream(split, seed)`; `n=None`: one pass over a finite split."""
        ...

    def reward(self, prompt: str, response: str, label: str) -> float:
        """Score of one response in [0, 1]; malformed responses score 0, never raise."""
        ...


class TaskBase:
    """Shared `examples` on top of `stream`."""

    name: str = "task"
    chat_template: bool | str = "auto"  # how prompts meet the tokenizer's chat template (rollverify.tasks.chat)

    def stream(self, split: str = "train", seed: int = 0) -> Iterator[Example]:  # pragma: no cover - abstract
        raise NotImplementedError

    def examples(self, split: str, n: int | None = None, seed: int = 0) -> list[Example]:
        check_split(split)
        if n is None:
            return self.all_examples(split, seed)
        return list(itertools.islice(self.stream(split, seed), n))

    def all_examples(self, split: str, seed: int = 0) -> list[Example]:
        """One pass over the split; tasks that generate prompts without end have none."""
        raise ValueError(f"task {self.name!r} generates {split} prompts without end: pass n")

    def reward(self, prompt: str, response: str, label: str) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def tool_registry(self):
        """The tools a multi-turn task's policy may call (a `rollverify.environment.tools.ToolRegistry`), or None:
        single-turn."""
        return None


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")


def hash_fraction(text: str, salt: str) -> float:
    """A deterministic number in [0, 1) for `text`: held-out membership that needs no stored list."""
    h = hashlib.sha256(f"{salt}\x00{text}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def stable_uid(*parts: object) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:16]
