"""Countdown: a synthetic task with a verifiable answer and long-tailed response lengths.

Prompt ``052 mod 7``; the model counts down by the stride, ``052 045 038 031 024 017 010 003``, and then writes
the answer line ``=003``: the remainder, found by repeated subtraction. A tiny model cannot shortcut the modulo,
so it has to walk the chain; each step is local (subtract a one-digit stride from the fixed-width number just
written; stop once it is below the stride), which a 2-layer character model learns in a minute on one CPU core.
Numbers are zero-padded to a fixed width so that "the previous number" sits at a fixed offset.

The number of terms k follows a truncated power law, so response lengths are long-tailed like reasoning traces:
most are short, a few are ten times the median, and those fail most often (every step must be right). That is
what makes partial rollout matter on this task.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from rollverify.tasks.base import SPLITS, Example, TaskBase, check_split, hash_fraction, stable_uid
from rollverify.tasks.chat import ChatTemplate, check_chat_template

_ANSWER = re.compile(r"=\s*(-?\d+)\s*")
_EOS_STRINGS = ("<|endoftext|>", "<|im_end|>")


@dataclass(frozen=True)
class CountdownTask(TaskBase):
    """``n mod s``: the countdown n, n-s, n-2s, ... down to the last non-negative term, then ``=remainder``.

    The number of terms k follows P(k) ~ k^-alpha on [k_min, k_max]; the stride s is uniform on
    [1, stride_max] and the remainder uniform on [0, s-1], so n = s*(k-1) + remainder. A prompt's split is a
    hash of its text (`split_salt`): train and eval never share a prompt and neither needs a stored list.
    """

    name: str = "countdown"
    stride_max: int = 9
    k_min: int = 2
    k_max: int = 48
    alpha: float = 1.3
    width: int = 3  # zero-pad every number to this many digits (0: natural width, much harder to learn)
    eval_fraction: float = 0.1
    split_salt: str = "countdown-v1"
    format_reward: float = 0.0  # score of a well-formed but wrong answer line (0: reward is correctness only)
    # Plain prompts: only `true` wraps them in the chat template. Not in repr: the tiny model's cache key hashes
    # the task's repr, and rendering does not change what the warm start learns.
    chat_template: ChatTemplate = field(default="auto", repr=False)
    _probs: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (1 <= self.k_min <= self.k_max):
            raise ValueError(f"need 1 <= k_min <= k_max; got k_min={self.k_min}, k_max={self.k_max}")
        if not (1 <= self.stride_max <= 9):
            raise ValueError(f"stride_max must be in [1, 9] (a one-digit stride); got {self.stride_max}")
        if self.width and len(str(self.max_start)) > self.width:
            raise ValueError(f"width={self.width} cannot hold {self.max_start}; raise width or lower k_max")
        if not (0.0 < self.eval_fraction < 1.0):
            raise ValueError(f"eval_fraction must be in (0, 1); got {self.eval_fraction}")
        check_chat_template(self.chat_template)
        if not (0.0 <= self.format_reward < 1.0):
            raise ValueError(f"format_reward must be in [0, 1); got {self.format_reward}")
        k = np.arange(self.k_min, self.k_max + 1, dtype=np.float64)
        p = k ** (-self.alpha)
        object.__setattr__(self, "_probs", p / p.sum())

    @property
    def max_start(self) -> int:
        return self.stride_max * self.k_max - 1

    def _fmt(self, x: int) -> str:
        return str(x).zfill(self.width)

    # --- prompts -------------------------------------------------------------------------------------------
    def make_example(self, stride: int, k: int, remainder: int) -> Example:
        if not (1 <= stride <= self.stride_max and 0 <= remainder < stride and k >= 1):
            raise ValueError(f"bad countdown: stride={stride}, k={k}, remainder={remainder}")
        start = stride * (k - 1) + remainder
        prompt = f"{self._fmt(start)} mod {stride}\n"
        return Example(
            uid=stable_uid(self.name, prompt),
            prompt=prompt,
            label=str(remainder),
            meta={"start": start, "stride": stride, "k": k},
        )

    def split_of(self, prompt: str) -> str:
        return "eval" if hash_fraction(prompt, self.split_salt) < self.eval_fraction else "train"

    def stream(self, split: str = "train", seed: int = 0) -> Iterator[Example]:
        """Prompts of one split drawn from the task's distribution (with replacement: the prompt space is
        small, ~2,100 for the defaults, and sampling with replacement keeps the eval split's length
        distribution equal to the train split's)."""
        check_split(split)
        rng = np.random.default_rng([seed, SPLITS.index(split), 0x5EED])
        ks = np.arange(self.k_min, self.k_max + 1)
        misses = 0
        while True:
            stride = int(rng.integers(1, self.stride_max + 1))
            k = int(rng.choice(ks, p=self._probs))
            ex = self.make_example(stride, k, int(rng.integers(0, stride)))
            if self.split_of(ex.prompt) == split:
                misses = 0
                yield ex
            else:
                misses += 1
                if misses > 100_000:
                    raise RuntimeError(
                        f"{self.name}: the {split} split is (almost) empty; change eval_fraction"
                    )

    # --- demonstrations and reward -------------------------------------------------------------------------
    def demonstration(self, ex: Example) -> str:
        """The correct response (without EOS): the supervised warm start trains on these."""
        m = ex.meta
        terms = [m["start"] - m["stride"] * j for j in range(m["k"])]
        return " ".join(map(self._fmt, terms)) + f"\n={self._fmt(terms[-1])}"

    @property
    def max_response_chars(self) -> int:
        """Length of the longest correct response: a generation budget that fits every demonstration."""
        w = self.width or len(str(self.max_start))
        return self.k_max * (w + 1) + w + 1

    def reward(self, prompt: str, response: str, label: str) -> float:
        """1.0 when the chain is followed by a last line ``=<label>``; `format_reward` for another number."""
        text = response
        for eos in _EOS_STRINGS:
            text = text.split(eos, 1)[0]
        lines = text.rstrip().split("\n")
        m = _ANSWER.fullmatch(lines[-1]) if len(lines) >= 2 and lines[0].strip() else None
        if m is None:
            return 0.0
        try:
            return 1.0 if int(m.group(1)) == int(label) else self.format_reward
        except ValueError:
            return 0.0
