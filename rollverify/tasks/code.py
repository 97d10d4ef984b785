"""Code generation: HumanEval, MBPP and LiveCodeBench problems, rewarded by their tests in the sandbox.

Problems come from files in the project's layout, which `tools/prepare_data.py` makes from the published ones
(verl's layout with ``ability: code``): the prompt as chat messages, and in ``reward_model.ground_truth`` a JSON
object naming the tests:

    {"kind": "humaneval", "test": "def check(candidate): ...", "entry_point": "f", "prompt": "def f(...):..."}
    {"kind": "mbpp", "test_list": ["assert f(1) == 2", ...], "test_setup_code": ""}
    {"kind": "stdio", "cases": [[input, output], ...]}                    (LiveCodeBench stdin problems)
    {"kind": "functional", "func_name": "maxSum", "cases": [[input, output], ...]}   (LiveCodeBench LeetCode)

The reward takes the last fenced code block of the policy's final turn (the whole final turn when there is
none), runs it in a fresh sandbox and decides the tests outside it (`code_reward`: the expected values never
reach the candidate; each case in its own process under its own timers) and scores 1.0 when every case passes,
else 0.0; `partial: true` scores the fraction passed. A HumanEval completion that does not
define its entry point is run after the problem's own prompt (the signature and docstring). Evaluation's pass@k
counts a response solved at reward 1 (`eval.solved_at`). With `tool: true` the policy may also call the Python
tool (to run its own checks) in the Qwen3 tool-call format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rollverify.environment.code_reward import CodeTests, code_reward
from rollverify.environment.limits import SandboxLimits
from rollverify.environment.sandbox import Sandbox
from rollverify.environment.tools import ToolRegistry, default_registry
from rollverify.tasks.chat import ChatTemplate
from rollverify.tasks.data import FileTask

ASSISTANT = "<|im_start|>assistant\n"
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)\n(.*?)```", re.DOTALL)
KINDS = ("humaneval", "mbpp", "stdio", "functional")


def parse_tests(label: str) -> tuple[CodeTests, str, str | None]:
    """The tests a label names, the program prefix (HumanEval's prompt; else empty) and the function the prefix
    declares (HumanEval's entry point; else None); ValueError when bad."""
    try:
        spec = json.loads(label)
    except ValueError:
        raise ValueError(f"a code label must be the JSON of its tests, got {label[:60]!r}") from None
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "humaneval":
        prompt = spec.get("prompt", "")
        entry = spec["entry_point"]
        return CodeTests.humaneval(spec["test"], entry, prompt=prompt), prompt, entry
    if kind == "mbpp":
        return CodeTests.mbpp(spec["test_list"], spec.get("test_setup_code", "")), "", None
    if kind == "stdio":
        return CodeTests.stdio_pairs([(str(i), str(o)) for i, o in spec["cases"]]), "", None
    if kind == "functional":
        return CodeTests.functional(spec["func_name"], [(str(i), str(o)) for i, o in spec["cases"]]), "", None
    raise ValueError(f"a code label's kind must be one of {KINDS}, got {kind!r}")


def extract_code(response: str) -> str:
    """The last fenced code block of the policy's final turn (the turn itself when it has none)."""
    turn = response.rsplit(ASSISTANT, 1)[-1]
    for eos in ("<|im_end|>", "<|endoftext|>"):
        turn = turn.split(eos, 1)[0]
    blocks = _FENCE.findall(turn)
    return blocks[-1] if blocks else turn


class CodeTask(FileTask):
    """Code problems from files (prepared by tools/prepare_data.py), rewarded by their tests in the sandbox."""

    def __init__(
        self,
        train_path: str | Path,
        eval_path: str | Path | None = None,
        *,
        prompt_key: str = "prompt",
        label_key: str = "auto",
        uid_key: str | None = None,
        eval_fraction: float = 0.05,
        name: str = "code",
        chat_template: ChatTemplate = "auto",
        partial: bool = False,
        per_case_s: float = 2.0,
        memory_mib: int = 1024,
        tool: bool = False,
    ) -> None:
        super().__init__(train_path, eval_path, prompt_key=prompt_key, label_key=label_key, uid_key=uid_key,
                         eval_fraction=eval_fraction, name=name, chat_template=chat_template)
        for split, exs in self._splits.items():
            for ex in exs[:1] + exs[-1:]:  # a file of another layout fails here, before any run
                try:
                    parse_tests(ex.label)
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{name}: {split} example {ex.uid}: {e} (tools/prepare_data.py writes the "
                                     "project's code layout)") from None
        self.partial, self.per_case_s, self.tool = bool(partial), float(per_case_s), bool(tool)
        self.limits = SandboxLimits(memory_bytes=int(memory_mib) << 20, wall_seconds=max(20.0, 10 * per_case_s))
        self._sandbox: Sandbox | None = None

    def tool_registry(self) -> ToolRegistry | None:
        return default_registry(self.limits) if self.tool else None

    def reward(self, prompt: str, response: str, label: str) -> float:
        return self.score(response, label).reward

    def score(self, response: str, label: str) -> Any:
        """The `CodeReward` of a response (passed, total, why)."""
        tests, prefix, entry = parse_tests(label)
        code = extract_code(response)
        if prefix and entry is not None and not _defines(code, entry):
            code = prefix + code
        if self._sandbox is None:
            self._sandbox = Sandbox(self.limits)
        return code_reward(code, tests, self._sandbox, partial=self.partial, per_case_s=self.per_case_s)


def _defines(code: str, name: str) -> bool:
    """Whether `code` defines the function `name` (HumanEval's entry point)."""
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
