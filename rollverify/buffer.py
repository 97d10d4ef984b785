"""The partial-rollout buffer: groups in flight, finished groups waiting to train, carried-over responses.

A group is finished when all n of its responses finished; finished groups leave (``pop_finished``) in the
order they completed, B at a time, as training batches. Everything else stays: after each optimizer step its
responses with tokens are the carried-over set that a strategy verifies (``carried_over``), truncation
decisions are applied (``apply_truncation``), and the next rollout resumes every unfinished response from
prompt + kept tokens with its remaining budget (``pending``: the responses themselves, which the engine
submits as they are).

Checkpoints hold no pickle: ``to_state`` gives a JSON-able dict plus a flat dict of numpy arrays, and
``save``/``load`` put both in one ``.npz`` file (the JSON as a uint8 array).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollverify.types import Group, Response

# what a checkpoint holds of each response as arrays (one written without `sources` loads as all policy tokens)
PER_RESPONSE_ARRAYS = ("token_ids", "logprobs", "versions", "sources", "routed_experts", "prompt_routed_experts")


@dataclass
class TokenCounts:
    """Tokens of the two sources (a cut's, a step's)."""

    policy: int = 0
    env: int = 0

    @property
    def total(self) -> int:
        return self.policy + self.env

    def __iadd__(self, other: TokenCounts) -> TokenCounts:
        self.policy += other.policy
        self.env += other.env
        return self


class RolloutBuffer:
    """Groups not yet consumed by training, keyed by group id, plus their completion order."""

    def __init__(self) -> None:
        self.groups: dict[int, Group] = {}
        self.completed: list[int] = []  # finished groups not yet popped, earliest first

    def add_group(self, group: Group) -> None:
        if group.group_id in self.groups:
            raise ValueError(f"group {group.group_id} is already in the buffer")
        self.groups[group.group_id] = group
        self._note(group)

    def get(self, response_id: str) -> Response:
        try:
            group_id, index = (int(x) for x in response_id.split("-"))
            return self.groups[group_id].responses[index]
        except (ValueError, KeyError, IndexError):
            raise KeyError(f"no response {response_id!r} in the buffer (ids are '<group_id>-<index>')") from None

    def record(
        self,
        response_id: str,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        versions: int | Sequence[int] | np.ndarray,
        routed_experts: np.ndarray | None = None,
        *,
        finish_reason: str | None = None,
        finished: bool | None = None,
        offset: int | None = None,
        prompt_routes: np.ndarray | None = None,
        prefix_routes: np.ndarray | None = None,
    ) -> bool:
        """Append one rollout output to its response; True when that completes the response's group.

        ``finished`` defaults to ``finish_reason in ("stop", "length")``. ``offset``, where the engine says the
        output starts, must be the response's length: the buffer is the controller's one copy, and an output
        that does not continue it is a lost or duplicated delta. ``prompt_routes`` / ``prefix_routes``: the
        engine's re-prefill of the prompt and of the tokens before the output (``Response.reroute``).
        """
        response = self.get(response_id)
        if offset is not None and offset != response.num_tokens:
            raise ValueError(
                f"response {response_id}: the engine's output starts at token {offset} but the buffer holds "
                f"{response.num_tokens}"
            )
        response.reroute(prompt_routes, prefix_routes)
        response.append(token_ids, logprobs, versions, routed_experts, finish_reason=finish_reason, finished=finished)
        return self._note(self.groups[response.group_id])

    @property
    def num_finished(self) -> int:
        return len(self.completed)

    def pop_finished(self, max_groups: int | None = None) -> list[Group]:
        """Remove and return up to ``max_groups`` finished groups, earliest completed first."""
        take = self.completed[:max_groups] if max_groups is not None else list(self.completed)
        self.completed = self.completed[len(take) :]
        return [self.groups.pop(g) for g in take]

    def carried_over(self) -> list[Response]:
        """Every response with tokens still in the buffer: all of them went stale at the last update."""
        return [r for g in self.groups.values() for r in g.responses if r.num_tokens]

    def apply_truncation(self, decisions: dict[str, int]) -> TokenCounts:
        """Cut responses to their keep lengths (response_id -> keep); return the tokens cut of each source."""
        cut = TokenCounts()
        for response_id, keep in decisions.items():
            r = self.get(response_id)
            env = r.num_env_tokens
            n = r.truncate(keep)
            cut += TokenCounts(n - (env - r.num_env_tokens), env - r.num_env_tokens)
        self.completed = [g for g in self.completed if self.groups[g].finished]
        return cut

    def pending(self) -> list[Response]:
        """Unfinished responses for the next rollout: those continuing earlier tokens first."""
        unfinished = [r for g in self.groups.values() for r in g.responses if not r.finished]
        unfinished.sort(key=lambda r: r.num_tokens == 0)
        return unfinished

    def _note(self, group: Group) -> bool:
        if group.finished and group.group_id not in self.completed:
            self.completed.append(group.group_id)
            return True
        return False

    # --- checkpoints --------------------------------------------------------------------------------------

    def to_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(JSON-able metadata, flat numpy arrays) describing the whole buffer."""
        meta: dict[str, Any] = {"completed": list(self.completed), "groups": []}
        arrays: dict[str, np.ndarray] = {}
        for g in self.groups.values():
            try:
                json.dumps(g.metadata)
            except TypeError as e:
                raise ValueError(f"group {g.group_id} metadata must be JSON-able: {e}") from None
            arrays[f"{g.group_id}/prompt_ids"] = g.prompt_ids
            responses = []
            for r in g.responses:
                for name in PER_RESPONSE_ARRAYS:
                    if getattr(r, name) is not None:
                        arrays[f"{r.response_id}/{name}"] = getattr(r, name)
                responses.append(
                    {
                        "max_new_tokens": r.max_new_tokens,
                        "finished": r.finished,
                        "finish_reason": r.finish_reason,
                        "reward": r.reward,
                    }
                )
            meta["groups"].append({"group_id": g.group_id, "n": g.n, "metadata": g.metadata, "responses": responses})
        return meta, arrays

    @classmethod
    def from_state(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> RolloutBuffer:
        buffer = cls()
        for gm in meta["groups"]:
            gid = gm["group_id"]
            prompt = np.asarray(arrays[f"{gid}/prompt_ids"])
            responses = []
            for i, rm in enumerate(gm["responses"]):
                per_token = {
                    name: np.asarray(arrays[key])
                    for name in PER_RESPONSE_ARRAYS
                    if (key := f"{gid}-{i}/{name}") in arrays
                }
                responses.append(Response(gid, i, prompt, **rm, **per_token))
            buffer.groups[gid] = Group(gid, prompt, gm["n"], responses, gm["metadata"])
        buffer.completed = list(meta["completed"])
        return buffer

    def save(self, path: str | Path) -> None:
        """One .npz file, no pickle: the metadata JSON rides along as a uint8 array."""
        meta, arrays = self.to_state()
        blob = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez(f, __meta__=blob, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> RolloutBuffer:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("__meta__").tobytes().decode())
        return cls.from_state(meta, arrays)
