"""ReTool-style math with a code interpreter: DAPO-Math prompts (or any prompt+label file `FileTask`
reads), the sandboxed Python tool in the Qwen3 chat template's tool-call format, and the math reward (boxed /
``Answer:`` extraction, math-verify) on the policy's final turn.

The tool is `python` (alias `code_interpreter`, as ReTool's prompts name it): each call runs its ``code`` in a
fresh sandbox (rollverify/environment/sandbox.py: CPU, memory, process and file-size limits, a wall-clock time-out
that kills the process group, its own folder, no network where the machine allows a namespace) and its stdout,
stderr and how it ended become the environment text. The prompt carries the tool's schema through the chat
template (`tools=`) and, as a system message, `instruction`.
"""

from __future__ import annotations

from pathlib import Path

from rollverify.environment.limits import SandboxLimits
from rollverify.environment.tools import ToolRegistry, default_registry
from rollverify.tasks.base import Example
from rollverify.tasks.chat import ChatTemplate
from rollverify.tasks.data import FileTask
from rollverify.tasks.math import math_reward

ASSISTANT = "<|im_start|>assistant\n"
INSTRUCTION = (
    "Solve the problem step by step. You may call the python tool to run code (computation, checking, search); "
    "its output is returned to you. Put the final answer in \\boxed{}."
)


class RetoolTask(FileTask):
    """Math prompts from a file, solved with the Python tool; reward on the final turn's answer."""

    def __init__(
        self,
        train_path: str | Path,
        eval_path: str | Path | None = None,
        *,
        prompt_key: str = "prompt",
        label_key: str = "auto",
        uid_key: str | None = None,
        eval_fraction: float = 0.05,
        name: str = "retool",
        chat_template: ChatTemplate = True,
        instruction: str | None = INSTRUCTION,
        memory_mib: int = 1024,
        cpu_seconds: float = 10.0,
    ) -> None:
        super().__init__(train_path, eval_path, prompt_key=prompt_key, label_key=label_key, uid_key=uid_key,
                         eval_fraction=eval_fraction, name=name, chat_template=chat_template)
        if memory_mib < 16 or cpu_seconds <= 0:
            raise ValueError(f"memory_mib must be >= 16 and cpu_seconds > 0; got {memory_mib}, {cpu_seconds}")
        self.instruction = instruction
        self.limits = SandboxLimits(memory_bytes=int(memory_mib) << 20, cpu_seconds=cpu_seconds)
        if instruction:
            for split, exs in self._splits.items():
                self._splits[split] = [self._instructed(e) for e in exs]

    def _instructed(self, ex: Example) -> Example:
        msgs = ex.messages or ({"role": "user", "content": ex.prompt},)
        if msgs[0]["role"] != "system":
            msgs = ({"role": "system", "content": self.instruction}, *msgs)
        return Example(ex.uid, ex.prompt, ex.label, ex.meta, tuple(msgs))

    def tool_registry(self) -> ToolRegistry:
        return default_registry(self.limits)

    def reward(self, prompt: str, response: str, label: str) -> float:
        """The math reward of the policy's last turn (a tool's output cannot answer for it)."""
        return math_reward(response.rsplit(ASSISTANT, 1)[-1], label)
