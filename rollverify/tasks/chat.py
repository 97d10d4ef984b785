"""Prompt rendering: the text and token ids the policy sees for an example (`task.options.chat_template`).

- ``auto`` (default): examples given as chat ``messages`` go through the tokenizer's chat template with
  ``add_generation_prompt=True`` and are then tokenized without special tokens, as verl does; plain-string
  prompts stay as they are. Without a chat template in the tokenizer, messages are joined as plain text.
- ``true``: every prompt goes through the template (a plain string as one user message); a tokenizer without a
  template is an error before anything starts.
- ``false``: never; messages are joined as plain text (`Example.prompt`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from rollverify.tasks.base import Example

ChatTemplate = Literal["auto"] | bool
CHAT_TEMPLATE_VALUES = ("auto", True, False)


def check_chat_template(value: Any) -> ChatTemplate:
    """`value` if it is auto, true or false; a ValueError naming the option otherwise."""
    if value == "auto" or isinstance(value, bool):
        return value
    raise ValueError(f"chat_template must be auto, true or false; got {value!r}")


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the tokenizer files of a local checkpoint carry a chat template (read without loading it)."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("chat_template"))


class PromptRenderer:
    """Renders examples for one tokenizer under one `chat_template` setting."""

    def __init__(self, tokenizer: Any, chat_template: Any = "auto", *, source: str | Path | None = None,
                 tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None  # a multi-turn task's tool schemas: the template lists them (`# Tools`)
        self.mode = check_chat_template(chat_template)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.mode is True and not self.has_template:
            where = f" at {source}" if source is not None else ""
            raise ValueError(
                f"task.options.chat_template is true but the tokenizer{where} has no chat template; "
                "set it to auto or false, or use a checkpoint whose tokenizer defines one"
            )

    def uses_template(self, ex: Example) -> bool:
        if self.mode == "auto":
            return ex.messages is not None and self.has_template
        return self.mode

    def text(self, ex: Example) -> str:
        """The prompt text the policy continues."""
        if not self.uses_template(ex):
            return ex.prompt
        messages = list(ex.messages) if ex.messages is not None else [{"role": "user", "content": ex.prompt}]
        kw = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)

    def ids(self, ex: Example) -> list[int]:
        """Token ids of `text(ex)`; the template already holds its special tokens, so none are added."""
        return list(self.tokenizer(self.text(ex), add_special_tokens=False)["input_ids"])
