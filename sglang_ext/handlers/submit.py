"""Reading a submit request into records, with every check run before any record exists (all-or-nothing)."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import numpy as np

from sglang_ext.protocol import (
    ENV_VERSION,
    UNKNOWN_VERSION,
    ErrorCode,
    Message,
    ProtocolError,
    SubmitBody,
    SubmitItem,
)
from sglang_ext.store import Record, RouteShape, new_record


@dataclass
class SubmitArrays:
    """A submit's buffers, items concatenated in order; the optional ones None when not sent."""

    prompts: np.ndarray  # int32, sum of prompt_len
    prefixes: np.ndarray  # int32, sum of prefix_len
    prefix_logprobs: np.ndarray | None
    prefix_versions: np.ndarray | None
    prefix_routes: np.ndarray | None  # [sum prefix_len, layers, top_k]
    prompt_routes: np.ndarray | None  # [sum (prompt_len - 1), layers, top_k]


def read_arrays(
    body: SubmitBody, msg: Message, route_shape: RouteShape | None, num_experts: int | None
) -> SubmitArrays:
    """The buffers, checked against the items' lengths, the served routes' shape and the expert count."""
    prompts = msg.array("prompt_ids", ["int32"], 1)
    prefixes = msg.array("prefix_ids", ["int32"], 1, required=False)
    plens = [it.prompt_len for it in body.items]
    xlens = [it.prefix_len for it in body.items]
    if len(prompts) != sum(plens):
        raise ProtocolError(
            ErrorCode.INVALID,
            f"prompt_ids has {len(prompts)} ids but the items' prompt_len sum to {sum(plens)}",
        )
    if prefixes is None:
        prefixes = np.zeros(0, np.int32)
    if len(prefixes) != sum(xlens):
        raise ProtocolError(
            ErrorCode.INVALID,
            f"prefix_ids has {len(prefixes)} ids but the items' prefix_len sum to {sum(xlens)}",
        )
    nx = sum(xlens)
    logprobs = msg.array("prefix_logprobs", ["float32"], 1, required=False)
    versions = msg.array("prefix_versions", ["int32"], 1, required=False)
    for k, arr in (("prefix_logprobs", logprobs), ("prefix_versions", versions)):
        if arr is not None and len(arr) != nx:
            raise ProtocolError(ErrorCode.INVALID, f"{k} has {len(arr)} entries, prefix_ids {nx}")
    if versions is not None and len(versions) and int(versions.min()) < ENV_VERSION:
        raise ProtocolError(
            ErrorCode.INVALID, f"prefix_versions holds {int(versions.min())}; versions are {ENV_VERSION} (an "
            f"environment token), {UNKNOWN_VERSION} (unknown) or >= 0"
        )
    prefix_routes = _routes(msg, "prefix_routed_experts", nx, route_shape, num_experts)
    prompt_routes = _routes(msg, "prompt_routed_experts", sum(plens) - len(plens), route_shape, num_experts)
    return SubmitArrays(prompts, prefixes, logprobs, versions, prefix_routes, prompt_routes)


def _routes(
    msg: Message, name: str, rows: int, rs: RouteShape | None, num_experts: int | None
) -> np.ndarray | None:
    arr = msg.array(name, ["uint8", "int16", "int32", "int64"], 3, required=False)
    if arr is None:
        return None
    if rs is None:
        raise ProtocolError(
            ErrorCode.INVALID, f"{name}: this server returns no routed experts (health: routed_experts)"
        )
    if arr.shape != (rows, rs.layers, rs.top_k):
        raise ProtocolError(
            ErrorCode.INVALID, f"{name} has shape {list(arr.shape)}, expected {[rows, rs.layers, rs.top_k]}"
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= int(num_experts)):
        raise ProtocolError(ErrorCode.INVALID, f"{name} holds expert ids outside [0, {num_experts})")
    return arr


def check_ids_unused(items: list[SubmitItem], held: Container[str]) -> None:
    """Response ids must be new to the server and distinct within the request."""
    seen: set[str] = set()
    dup = []
    for it in items:
        if it.rid in held or it.rid in seen:
            dup.append(it.rid)
        seen.add(it.rid)
    if dup:
        raise ProtocolError(
            ErrorCode.DUPLICATE_RESPONSE, f"response id(s) already in use: {dup[:10]}; nothing was submitted"
        )


def check_token_ids(body: SubmitBody, arrays: SubmitArrays, vocab: int) -> None:
    """Prompt, prefix and stop-token ids inside the vocabulary."""
    for arr, what in ((arrays.prompts, "prompt_ids"), (arrays.prefixes, "prefix_ids")):
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
            raise ProtocolError(ErrorCode.INVALID, f"{what} holds ids outside [0, {vocab})")
    for sp, what in [(body.sampling, "sampling")] + [
        (it.sampling, f"items.{i}.sampling") for i, it in enumerate(body.items) if it.sampling is not None
    ]:
        if sp.stop_token_ids and max(sp.stop_token_ids) >= vocab:
            raise ProtocolError(ErrorCode.INVALID, f"{what}.stop_token_ids holds ids outside [0, {vocab})")


def check_budgets(items: list[SubmitItem], context_len: int) -> None:
    """A prefix fits the budget, and prompt + budget fit the context (0: unknown, unchecked). A prefix that fills
    its budget is a whole response (its launch finishes it as "length", as it does a paused one at its budget):
    SGLang's abort can race its length check, so a response may be paused, checkpointed or resubmitted after a
    lost server with every budgeted token and no finish."""
    ctx = context_len
    for it in items:
        if it.prefix_len > it.max_new_tokens:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"response {it.rid}: prefix_len {it.prefix_len} exceeds its budget max_new_tokens {it.max_new_tokens}",
            )
        if ctx and it.prompt_len + it.max_new_tokens > ctx:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"response {it.rid}: prompt {it.prompt_len} + max_new_tokens {it.max_new_tokens} exceed the "
                f"context length {ctx}",
            )
        if ctx and it.prefix_len < it.max_new_tokens and it.prompt_len + it.prefix_len >= ctx:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"response {it.rid}: prompt + prefix of {it.prompt_len + it.prefix_len} tokens reach the context length {ctx}",
            )


def build_records(body: SubmitBody, arrays: SubmitArrays, route_shape: RouteShape | None) -> list[Record]:
    """One record per item, its slices of the buffers copied in; one SGLang sampling dict per distinct params."""
    p = x = q = 0
    new = []
    dumped: dict[int, dict] = {}
    for it in body.items:
        sp = it.sampling or body.sampling
        args = dumped.get(id(sp))
        if args is None:
            args = dumped[id(sp)] = sp.model_dump(exclude_none=True)
        sl, xl = slice(p, p + it.prompt_len), slice(x, x + it.prefix_len)
        ql = slice(q, q + it.prompt_len - 1)
        new.append(
            new_record(
                it.rid,
                arrays.prompts[sl],
                arrays.prefixes[xl],
                it.max_new_tokens,
                sp,
                route_shape,
                prefix_logprobs=_part(arrays.prefix_logprobs, xl),
                prefix_versions=_part(arrays.prefix_versions, xl),
                prefix_routes=_part(arrays.prefix_routes, xl),
                prompt_routes=_part(arrays.prompt_routes, ql),
                sampling_args=args,
            )
        )
        p, x, q = p + it.prompt_len, x + it.prefix_len, q + it.prompt_len - 1
    return new


def _part(arr: np.ndarray | None, sl: slice) -> np.ndarray | None:
    return None if arr is None else arr[sl]
