"""Tool chain: the synthetic multi-turn tool task, the embedded default for tool use on a CPU.

A hidden table links three-digit nodes into chains. The prompt ``walk 123`` names a chain's head; the tool
``next`` answers a node with the next one (``456``) or, at the chain's end, with its answer (``=789``). The
response walks the chain one call per turn and ends with the answer line ``=789``:

    <tool_call>\\n{"name": "next", "arguments": {"x": 123}}\\n</tool_call>      policy
    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n456\\n</tool_response>     environment
    <|im_end|>\\n<|im_start|>assistant\\n
    <tool_call>\\n{"name": "next", "arguments": {"x": 456}}\\n</tool_call>      policy
    ... =789                                                                   environment
    =789<|endoftext|>                                                          policy

The table is pseudo-random, so without the tool the answer is a guess (1 in 1000): using the tool pays. Each
turn is local (copy the three digits just shown into the next call, or the answer line after a ``=``), which a
2-layer character model learns in a short warm start. Chain lengths follow a truncated power law, so the number
of turns (and the response length) is long-tailed; the tool's latency is log-normal per call (seeded by the
call), so the tail includes tool waits.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollverify.environment.tool_calls import IM_END, format_tool_call, tool_response_text
from rollverify.environment.tools import ToolOutput, ToolRegistry
from rollverify.tasks.base import SPLITS, Example, TaskBase, check_split, hash_fraction, stable_uid

_ANSWER = re.compile(r"=(\d{3})")
_EOS_STRINGS = ("<|endoftext|>", IM_END)
ASSISTANT = "<|im_start|>assistant\n"


@dataclass(frozen=True)
class ToolChainTask(TaskBase):
    """``walk <head>``: the answer at the end of its chain, found by calling ``next`` once per node."""

    name: str = "toolchain"
    k_min: int = 1  # nodes per chain (= tool calls of a correct response)
    k_max: int = 8
    alpha: float = 1.2  # P(k) ~ k^-alpha
    table_seed: int = 0
    eval_fraction: float = 0.15
    split_salt: str = "toolchain-v1"
    latency_median_s: float = field(default=0.02, repr=False)  # the tool's latency (not in the model's cache key)
    latency_sigma: float = field(default=1.0, repr=False)
    chat_template: str = field(default="auto", repr=False)
    _next: dict = field(init=False, repr=False, compare=False)
    _heads: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max <= 64:
            raise ValueError(f"need 1 <= k_min <= k_max <= 64; got k_min={self.k_min}, k_max={self.k_max}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1); got {self.eval_fraction}")
        if self.latency_median_s < 0 or self.latency_sigma < 0:
            raise ValueError("latency_median_s and latency_sigma must be >= 0")
        rng = np.random.default_rng([self.table_seed, 0x7001])
        nodes = rng.permutation(1000).tolist()
        ks = np.arange(self.k_min, self.k_max + 1)
        p = ks.astype(np.float64) ** -self.alpha
        nxt: dict[int, str] = {}
        heads: list[tuple[int, int, str]] = []  # (head, k, answer)
        while nodes:
            k = min(int(rng.choice(ks, p=p / p.sum())), len(nodes))
            chain, nodes = nodes[:k], nodes[k:]
            answer = f"{int(rng.integers(0, 1000)):03d}"
            for a, b in zip(chain, chain[1:], strict=False):
                nxt[a] = f"{b:03d}"
            nxt[chain[-1]] = "=" + answer
            heads.append((chain[0], len(chain), answer))
        object.__setattr__(self, "_next", nxt)
        object.__setattr__(self, "_heads", tuple(heads))

    # --- the tool -----------------------------------------------------------------------------------------

    def lookup(self, x: Any) -> str:
        """The tool's answer for node `x` (environment text, never an exception)."""
        if isinstance(x, bool) or not isinstance(x, int | str) or not str(x).isdigit():
            return f"error: x must be a node number, got {x!r}"
        return self._next.get(int(x), f"error: no node {x}")

    def tool_registry(self) -> ToolRegistry:
        return ToolRegistry([NextTool(self)])

    # --- prompts ------------------------------------------------------------------------------------------

    def _example(self, head: int, k: int, answer: str) -> Example:
        prompt = f"walk {head:03d}\n"
        return Example(stable_uid(self.name, prompt), prompt, answer, {"head": head, "k": k})

    def stream(self, split: str = "train", seed: int = 0) -> Iterator[Example]:
        """Chain heads of one split, drawn with replacement (their lengths keep the table's power law)."""
        check_split(split)
        pool = [h for h in self._heads if self._split_of(h[0]) == split]
        if not pool:
            raise RuntimeError(f"{self.name}: the {split} split is empty; change eval_fraction or table_seed")
        rng = np.random.default_rng([seed, SPLITS.index(split), 0x7002])
        while True:
            yield self._example(*pool[int(rng.integers(0, len(pool)))])

    def _split_of(self, head: int) -> str:
        return "eval" if hash_fraction(f"{head:03d}", self.split_salt) < self.eval_fraction else "train"

    # --- demonstrations and reward ------------------------------------------------------------------------

    def demonstration_segments(self, ex: Example) -> list[tuple[str, bool]]:
        """The correct response as (text, is the policy's) parts: the warm start trains the policy's only."""
        parts: list[tuple[str, bool]] = []
        x = f"{ex.meta['head']:03d}"
        while True:
            parts.append((format_tool_call("next", {"x": x}), True))
            out = self.lookup(x)
            parts.append((tool_response_text([out], turn_closed=False), False))
            if out.startswith("="):
                parts.append((out, True))
                return parts
            x = out

    def demonstration(self, ex: Example) -> str:
        return "".join(text for text, _ in self.demonstration_segments(ex))

    @property
    def max_response_chars(self) -> int:
        return self.k_max * 80 + 8

    def reward(self, prompt: str, response: str, label: str) -> float:
        """1.0 when the policy's last turn is exactly the answer line ``=<label>``."""
        text = response.rsplit(ASSISTANT, 1)[-1]
        for eos in _EOS_STRINGS:
            text = text.split(eos, 1)[0]
        m = _ANSWER.fullmatch(text.strip())
        return 1.0 if m is not None and m.group(1) == label else 0.0


class NextTool:
    """The task's ``next`` tool: a table lookup with a log-normal latency seeded by the call."""

    name = "next"

    def __init__(self, task: ToolChainTask) -> None:
        self.task = task

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": "The node after x in its chain, or =ANSWER at the chain's end.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}

    def run(self, arguments: dict[str, Any], time_limit_s: float) -> ToolOutput:
        extra = set(arguments) - {"x"}
        if extra or "x" not in arguments:
            return ToolOutput(f'error: next takes exactly {{"x": NODE}}, got {json.dumps(arguments)[:80]}', False,
                              "bad_arguments")
        t = self.task
        if t.latency_median_s > 0:
            z = np.random.default_rng([t.table_seed, abs(hash(str(arguments["x"]))) % (1 << 32)]).standard_normal()
            time.sleep(min(time_limit_s, t.latency_median_s * math.exp(t.latency_sigma * float(z))))
        text = t.lookup(arguments["x"])
        return ToolOutput(text, not text.startswith("error"), "tool_error" if text.startswith("error") else None)
