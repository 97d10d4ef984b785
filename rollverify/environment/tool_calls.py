"""Tool calls and tool responses in the Qwen3 chat template's text format (Hermes style).

The template (Qwen3's `tokenizer_config.json` chat_template) renders
- an assistant turn's calls as `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, several calls
  separated by a newline, the turn closed by `<|im_end|>\\n`;
- the tool messages that follow as ONE user turn:
  `<|im_start|>user` + (`\\n<tool_response>\\n` + CONTENT + `\\n</tool_response>`) per tool message + `<|im_end|>\\n`;
- then the generation prompt `<|im_start|>assistant\\n` (followed by `<think>\\n\\n</think>\\n\\n` when thinking is off).

`parse_tool_calls` reads the calls of a policy turn (a malformed one is a `MalformedCall`, never an exception);
`tool_response_text` is the environment text that follows that turn, so the token stream equals what the template
would render for the same conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Generation stops when a call closes, so the call runs before the policy writes anything after it.
STOP_STRINGS: tuple[str, ...] = (TOOL_CALL_CLOSE,)
NO_THINKING_PREFIX = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: `index` is its place among the turn's calls, `raw` the text between the tags."""

    name: str
    arguments: dict[str, Any]
    index: int
    raw: str


@dataclass(frozen=True)
class MalformedCall:
    """A call that could not be read; `error` says why, for the environment text the policy sees."""

    raw: str
    error: str
    index: int


ParsedCall = ToolCall | MalformedCall


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every `<tool_call>` block of `text`, in order. An unclosed block (the turn ran out of tokens or stopped
    inside it) and a closing tag without an opening one are malformed calls; text outside blocks is ignored."""
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        stray = text.find(TOOL_CALL_CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            calls.append(
                MalformedCall(raw="", error=f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}", index=len(calls))
            )
            pos = stray + len(TOOL_CALL_CLOSE)
            continue
        if start == -1:
            return calls
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            raw = text[body_start:]
            calls.append(
                MalformedCall(
                    raw=raw, error=f"{TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}", index=len(calls)
                )
            )
            return calls
        calls.append(_parse_one(text[body_start:end], len(calls)))
        pos = end + len(TOOL_CALL_CLOSE)


def _parse_one(raw: str, index: int) -> ParsedCall:
    body = raw.strip()
    if TOOL_CALL_OPEN in body:
        return MalformedCall(raw, f"a {TOOL_CALL_OPEN} inside another call", index)
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return MalformedCall(raw, f"the call is not valid JSON ({exc})", index)
    if not isinstance(obj, dict):
        return MalformedCall(raw, 'the call must be a JSON object {"name": ..., "arguments": {...}}', index)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(raw, 'the call has no "name" string', index)
    args = obj.get("arguments", {})
    if isinstance(args, str):
        # The template writes string arguments verbatim, so a JSON object given as a string is accepted too.
        try:
            args = json.loads(args)
        except ValueError:
            return MalformedCall(raw, f'"arguments" of {name!r} is a string that is not a JSON object', index)
    if not isinstance(args, dict):
        return MalformedCall(raw, f'"arguments" of {name!r} must be a JSON object', index)
    return ToolCall(name=name, arguments=args, index=index, raw=raw)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as the template renders it (json.dumps with its default separators, like the template's tojson)."""
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{TOOL_CALL_CLOSE}'


def tool_response_text(contents: Sequence[str], *, turn_closed: bool, thinking: bool = True) -> str:
    """The environment text after a policy turn whose calls produced `contents` (one per call, in call order).

    turn_closed: whether the policy's tokens already end the turn with `<|im_end|>`; when generation stopped at
    the stop string `</tool_call>` instead, the environment closes the turn. thinking=False appends the empty
    think block the template adds when thinking is disabled.
    """
    if not contents:
        raise ValueError("tool_response_text needs the content of at least one tool call")
    head = "\n" if turn_closed else f"{IM_END}\n"
    body = "".join(f"\n{TOOL_RESPONSE_OPEN}\n{c}\n{TOOL_RESPONSE_CLOSE}" for c in contents)
    tail = f"{IM_END}\n{IM_START}assistant\n" + ("" if thinking else NO_THINKING_PREFIX)
    return f"{head}{IM_START}user{body}{tail}"
