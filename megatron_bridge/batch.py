"""Trainer-side batch: sequences of (prompt, generated tokens[, routed experts]) packed into micro-batches.

A sequence of P prompt and G generated tokens enters the model as its first P + G - 1 tokens: the last token is
never an input (nothing is predicted from it), and that is exactly the span whose routing the engine reports
(SGLang's routed experts are `[P + G - 1, moe_layers, top_k]`). Generated token j is predicted at position
`P - 1 + j` of its sequence. Micro-batches are greedy runs of whole sequences up to a token budget (a longer
sequence gets a micro-batch of its own), in batch order, so results come back in batch order without a sort;
inside a micro-batch the sequences are packed end to end (THD, see `model.PackedSequences`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_bridge.model import PackedSequences


@dataclass
class TrainSequence:
    """One response as the trainer sees it. Arrays are numpy; only `prompt_ids` and `gen_ids` are required."""

    prompt_ids: np.ndarray  # [P] int
    gen_ids: np.ndarray  # [G] int, G >= 1
    routed_experts: np.ndarray | None = None  # [P + G - 1, moe_layers, top_k] int32, engine's routing
    rollout_logprobs: np.ndarray | None = None  # [G] float32, engine's log-probs (temperature-scaled)
    rollout_versions: np.ndarray | None = None  # [G] int, the policy version that sampled each token
    advantage: float | np.ndarray | None = None  # scalar (GRPO) or [G]
    loss_mask: np.ndarray | None = None  # [G] bool/0-1; None = every generated token counts

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64).reshape(-1)
        self.gen_ids = np.asarray(self.gen_ids, dtype=np.int64).reshape(-1)
        if self.prompt_ids.size < 1 or self.gen_ids.size < 1:
            raise ValueError(f"a sequence needs >= 1 prompt and >= 1 generated token, got "
                             f"{self.prompt_ids.size} and {self.gen_ids.size}")
        g = self.gen_ids.size
        for name in ("rollout_logprobs", "rollout_versions", "loss_mask"):
            v = getattr(self, name)
            if v is not None and np.asarray(v).reshape(-1).size != g:
                raise ValueError(f"{name} has {np.asarray(v).size} entries for {g} generated tokens")

    @property
    def num_inputs(self) -> int:
        return self.prompt_ids.size + self.gen_ids.size - 1


@dataclass
class MicroBatch:
    packed: PackedSequences
    seq_index: list[int]  # batch indices of the sequences in this micro-batch
    gen_rows: torch.Tensor  # [N] indices into the packed [T] tokens whose outputs predict generated tokens
    gen_targets: torch.Tensor  # [N] the generated tokens
    gen_counts: list[int]  # per sequence
    routes: list[torch.Tensor] | None = None  # per MoE layer [S, top_k] (filled by replay.attach)
    extras: dict = field(default_factory=dict)


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy consecutive grouping of sequence indices so that each group's tokens stay within `budget`."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def make_micro_batch(seqs: list[TrainSequence], index: list[int], pad_to_multiple: int = 1,
                     segment_multiple: int = 1) -> MicroBatch:
    inputs = [torch.from_numpy(np.concatenate([seqs[i].prompt_ids, seqs[i].gen_ids])[:-1]) for i in index]
    packed = PackedSequences.pack(inputs, pad_to_multiple, segment_multiple)
    rows, targets, counts = [], [], []
    for k, i in enumerate(index):
        s = seqs[i]
        rows.append(packed.flat_rows(k, s.prompt_ids.size - 1, s.gen_ids.size))
        targets.append(torch.from_numpy(s.gen_ids))
        counts.append(s.gen_ids.size)
    return MicroBatch(packed, list(index), torch.cat(rows), torch.cat(targets), counts)


def split_for_data_parallel(lengths: list[int], dp: int) -> list[list[int]]:
    """Balance sequences over `dp` ranks by tokens (longest first onto the lightest rank); keeps batch order
    inside each rank. Deterministic, so every rank computes the same split without communication."""
    loads = [0] * dp
    parts: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        r = min(range(dp), key=lambda k: (loads[k], k))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


@dataclass(frozen=True)
class BatchLayout:
    """What a driver needs to cut a batch for the trainer's ranks and check it first
    (`MegatronTrainer.batch_layout`): the data-parallel size and each rank's DP rank, whether the calls replay
    routes, and the limits every rank checks."""

    dp: int
    dp_ranks: tuple[int, ...]
    moe: bool
    replay_train: bool
    replay_verify: bool
    weighting: str | None  # the stale-token correction's weight (it reads the engine's log-probs); None: none
    max_seq_len: int
    context_length: int
    vocab_size: int
    num_layers: int
    top_k: int
    num_experts: int


@dataclass
class BatchShare:
    """One data-parallel rank's part of a batch, cut in the driver (`share_batch`) so each rank receives only
    what it computes: its sequences `seqs` at batch indices `index`, and what every rank needs of the whole
    batch: each sequence's model inputs (`lengths`: every rank plans every DP rank's micro-batches, so all run
    the same number) and generated tokens (`gen_counts`: the per-token arrays the trainer returns are flat over
    the batch)."""

    dp: int
    dp_rank: int
    index: list[int]
    seqs: list[TrainSequence]
    lengths: list[int]
    gen_counts: list[int]

    def nbytes(self) -> int:
        """Bytes of the sequences' arrays (what crosses to the rank, besides a few integers per sequence)."""
        return sum(sequence_bytes(s) for s in self.seqs)


def sequence_bytes(s: TrainSequence) -> int:
    return sum(np.asarray(v).nbytes for v in (s.prompt_ids, s.gen_ids, s.routed_experts, s.rollout_logprobs,
                                               s.rollout_versions, s.advantage, s.loss_mask) if v is not None)


def share_batch(batch, dp: int, *, routes: bool) -> list[BatchShare]:
    """`batch` cut into one `BatchShare` per data-parallel rank by the rule the ranks use
    (`split_for_data_parallel`); the routed experts stay behind unless the call uses them (`routes`)."""
    seqs = sequences(batch)
    lengths = [s.num_inputs for s in seqs]
    gens = [s.gen_ids.size for s in seqs]
    out = []
    for r, index in enumerate(split_for_data_parallel(lengths, dp)):
        mine = [seqs[i] if routes or seqs[i].routed_experts is None else
                dataclasses.replace(seqs[i], routed_experts=None) for i in index]
        out.append(BatchShare(dp, r, index, mine, lengths, gens))
    return out


class RankBatch(list):
    """A batch as one trainer rank sees it: item i is sequence i where this rank has it (all of them for a
    whole batch, its data-parallel share for a `BatchShare`), else None; `lengths` and `gen_counts` cover every
    sequence; `whole` says whether every rank holds every sequence."""

    lengths: list[int]
    gen_counts: list[int]
    whole: bool


def rank_batch(batch, dp: int, dp_rank: int) -> RankBatch:
    """`batch` (any sequence of TrainSequence, or this rank's `BatchShare`) as a `RankBatch`."""
    if isinstance(batch, RankBatch):
        return batch
    if isinstance(batch, BatchShare):
        if (batch.dp, batch.dp_rank) != (dp, dp_rank):
            raise ValueError(f"a batch share of data-parallel rank {batch.dp_rank} of {batch.dp} reached rank "
                             f"{dp_rank} of {dp}")
        out = RankBatch([None] * len(batch.lengths))
        for i, s in zip(batch.index, sequences(batch.seqs), strict=True):
            out[i] = s
        out.lengths, out.gen_counts, out.whole = list(batch.lengths), list(batch.gen_counts), False
        return out
    out = RankBatch(sequences(batch))
    out.lengths, out.gen_counts, out.whole = [s.num_inputs for s in out], [s.gen_ids.size for s in out], True
    return out


def sequences(batch) -> list[TrainSequence]:
    """`batch` as a list, every item a TrainSequence (the trainer's methods take any sequence of them)."""
    seqs = list(batch)
    for i, s in enumerate(seqs):
        if not isinstance(s, TrainSequence):
            raise TypeError(f"sequence {i} is a {type(s).__name__}, not a TrainSequence "
                            "(megatron_bridge.loop_adapter.train_sequence converts a rollverify Response)")
    return seqs


def check_batch(seqs: list[TrainSequence], *, max_seq_len: int, context_length: int, vocab_size: int) -> None:
    """Every rank checks the whole batch before any forward: too long a sequence, or a token outside the
    vocabulary, fails here with its numbers instead of inside a collective. `max_seq_len` is the trainer's
    setting (0: the model's `context_length`)."""
    limit = max_seq_len or context_length
    for i, s in enumerate(seqs):
        if s is None:  # another data-parallel rank's sequence
            continue
        if s.num_inputs > limit:
            raise ValueError(
                f"sequence {i} has {s.prompt_ids.size} prompt + {s.gen_ids.size} generated tokens = "
                f"{s.num_inputs} model inputs, more than the trainer's context of {limit} (trainer "
                f"max_seq_len={max_seq_len}, model context {context_length}): shorten the response or raise "
                f"max_seq_len")
        lo = min(int(s.prompt_ids.min()), int(s.gen_ids.min()))
        hi = max(int(s.prompt_ids.max()), int(s.gen_ids.max()))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"sequence {i} has token ids in [{lo}, {hi}], outside the model's vocabulary "
                             f"[0, {vocab_size})")
