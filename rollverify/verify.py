"""Off-policy shift (OPS) and the two-stage verification of carried-over responses.

The inputs are *packed*: the generated tokens of R responses laid end to end in one 1-D tensor, with
``lengths[r]`` tokens for response r (``sum(lengths) == N``). For generated token j:

    D[j] = |exp(lp_new[j] - lp_old[j]) - 1|                     (float32; NaN/inf in either input -> inf)

Segments are maximal runs of equal policy version inside one response. Verification keeps a prefix:

    L1 = start of the first segment whose mean D >= d_s                  (else the whole response)
    L2 = index of the first token in [0, L1) with D >= d_t               (else L1)

and ``keep_lengths = L2``. An infinite threshold turns its stage off.

Everything is vectorised. On CPU the tokens stream through in cache-sized blocks; per block the only
per-token work is computing D and one sum per row of ``ROW`` tokens. Segment sums and the token-stage
search then touch only rows that matter: the rows holding a segment boundary, and the rows whose sum
reaches d_t (D >= 0, so a row holding a token >= d_t has a row sum >= d_t).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

ROW = 64  # tokens per row of the two-level sum
CPU_BLOCK = 1 << 19  # tokens per streamed block on CPU (2 MiB of float32: stays in L2)

TensorLike = Tensor | np.ndarray
Fill = Callable[[int, int, Tensor], None]  # fill(s, e, out): write D of tokens [s, e) into out


@dataclass
class VerifyResult:
    """Keep lengths plus the statistics the training loop reports (all tensors on the input device)."""

    keep_lengths: Tensor  # [R] int64: L2, the verified prefix of each response
    seq_keep_lengths: Tensor  # [R] int64: L1, the prefix after the sequence-level stage alone
    lengths: Tensor  # [R] int64: tokens verified per response
    response_mean_ops: Tensor  # [R] float64: mean D over the whole response (NaN when empty)
    segment_starts: Tensor  # [S] int64: packed position of each segment's first token
    segment_lengths: Tensor  # [S] int64
    segment_response: Tensor  # [S] int64: response index of each segment
    segment_versions: Tensor  # [S] int64: policy version of each segment
    segment_mean_ops: Tensor  # [S] float64: mean D of each segment

    @property
    def kept_tokens(self) -> int:
        return int(self.keep_lengths.sum())

    @property
    def verified_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def acceptance_rate(self) -> float:
        """Kept tokens / verified tokens (1.0 when there was nothing to verify)."""
        verified = self.verified_tokens
        return self.kept_tokens / verified if verified else 1.0

    @property
    def kept_whole_rate(self) -> float:
        """Share of responses kept in full (1.0 when there were none)."""
        n = self.lengths.numel()
        return float((self.keep_lengths == self.lengths).sum()) / n if n else 1.0


def token_ops(old_logprobs: Tensor, new_logprobs: Tensor, out: Tensor | None = None) -> Tensor:
    """D = |exp(lp_new - lp_old) - 1| in float32, elementwise; a NaN or inf in either input gives inf.

    Non-finite differences are mapped to +inf *before* the exponential, so that lp_new = -inf (the new
    policy forbids the token) fails every check instead of landing on |0 - 1| = 1.
    """
    x = torch.sub(new_logprobs.float(), old_logprobs.float(), out=out)
    x.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=math.inf)
    return x.exp_().sub_(1.0).abs_()


def two_stage_verify(
    old_logprobs: TensorLike,
    new_logprobs: TensorLike,
    versions: TensorLike,
    lengths: TensorLike,
    d_s: float = 0.01,
    d_t: float = 2.0,
    *,
    block: int | None = None,
) -> VerifyResult:
    """Two-stage verification of packed responses; ``result.keep_lengths`` is the prefix to keep.

    old_logprobs: [N] the engine's log-prob of each generated token when it was sampled.
    new_logprobs: [N] the trainer's log-prob of the same token under the newly trained policy.
    versions:     [N] integer policy version that generated each token.
    lengths:      [R] integer token count per response, summing to N.
    d_s, d_t:     sequence- and token-level thresholds, >= 0; ``math.inf`` turns a stage off.
    block:        tokens per streamed block (default: cache-sized on CPU, everything at once elsewhere).
    """
    old, new = _as_tensor(old_logprobs, "old_logprobs"), _as_tensor(new_logprobs, "new_logprobs")
    if not (old.is_floating_point() and old.dim() == 1):
        raise ValueError(f"old_logprobs must be a 1-D float tensor [N], got {old.dtype} {tuple(old.shape)}")
    if not (new.is_floating_point() and new.shape == old.shape):
        raise ValueError(
            f"new_logprobs must be a float tensor shaped like old_logprobs {tuple(old.shape)}, "
            f"got {new.dtype} {tuple(new.shape)}"
        )
    if new.device != old.device:
        raise ValueError(f"new_logprobs must be on old_logprobs' device {old.device}, got {new.device}")
    versions, lengths = _check_segments_input(versions, lengths, old.shape[0], old.device)
    d_s, d_t = _check_threshold(d_s, "d_s"), _check_threshold(d_t, "d_t")

    block = _check_block(block, old)

    def fill(s: int, e: int, out: Tensor) -> None:
        token_ops(old[s:e], new[s:e], out=out)

    return _verify(fill, versions, lengths, d_s, d_t, block)


def two_stage_verify_ops(
    ops: TensorLike,
    versions: TensorLike,
    lengths: TensorLike,
    d_s: float = 0.01,
    d_t: float = 2.0,
    *,
    block: int | None = None,
) -> VerifyResult:
    """The same verification from precomputed token OPS ``ops`` = D ([N], >= 0; NaN counts as inf)."""
    d = _as_tensor(ops, "ops")
    if not (d.is_floating_point() and d.dim() == 1):
        raise ValueError(f"ops must be a 1-D float tensor [N], got {d.dtype} {tuple(d.shape)}")
    if d.numel() and not bool((d >= 0).logical_or_(d.isnan()).all()):
        raise ValueError("ops must be >= 0 (D = |ratio - 1|) or NaN, got a negative value")
    versions, lengths = _check_segments_input(versions, lengths, d.shape[0], d.device)
    d_s, d_t = _check_threshold(d_s, "d_s"), _check_threshold(d_t, "d_t")
    block = _check_block(block, d)

    def fill(s: int, e: int, out: Tensor) -> None:
        out.copy_(d[s:e]).nan_to_num_(nan=math.inf)

    return _verify(fill, versions, lengths, d_s, d_t, block)


# --- the algorithm ----------------------------------------------------------------------------------------


def _verify(fill: Fill, versions: Tensor, lengths: Tensor, d_s: float, d_t: float, block: int) -> VerifyResult:
    """Both stages, on D streamed in by ``fill``."""
    n = versions.shape[0]
    ends = torch.cumsum(lengths, 0)
    offsets = ends - lengths
    starts = _segment_starts(versions, offsets[lengths > 0])
    seg_len = torch.diff(starts, append=starts.new_tensor([n]))
    seg_resp = torch.searchsorted(ends, starts, right=True)
    t = _float32_at_least(d_t)
    split_rows = torch.unique_consecutive(starts[starts % ROW != 0] // ROW)
    row_sums, split_ops, hot = _stream(fill, n, block, split_rows, t)
    seg_sum = _segment_sums(row_sums, split_rows, split_ops, starts, n)
    seg_mean = seg_sum / seg_len

    # Sequence stage: the first segment with mean D >= d_s, and everything after it, is cut.
    keep1 = lengths.clone()
    if d_s < math.inf:
        bad = seg_mean >= d_s
        keep1.scatter_reduce_(0, seg_resp[bad], (starts - offsets[seg_resp])[bad], "amin")

    # Token stage: the first token in [0, L1) with D >= d_t, and everything after it, is cut.
    keep2 = keep1.clone()
    if t < math.inf:
        resp = torch.searchsorted(ends, hot, right=True)
        keep2.scatter_reduce_(0, resp, hot - offsets[resp], "amin")

    resp_sum = torch.zeros_like(lengths, dtype=torch.float64).index_add_(0, seg_resp, seg_sum)
    return VerifyResult(
        keep_lengths=keep2,
        seq_keep_lengths=keep1,
        lengths=lengths,
        response_mean_ops=resp_sum / lengths,
        segment_starts=starts,
        segment_lengths=seg_len,
        segment_response=seg_resp,
        segment_versions=versions[starts].long(),
        segment_mean_ops=seg_mean,
    )


def _stream(fill: Fill, n: int, block: int, split_rows: Tensor, t: float) -> tuple[Tensor, Tensor, Tensor]:
    """One pass over D in blocks of whole rows: (row sums, the split rows' D, sorted positions of D >= t).

    Tokens >= t are searched only in rows whose sum reaches t: D >= 0, so every such token is in one.
    """
    device = split_rows.device
    n_rows = -(-n // ROW)
    row_sums = torch.empty(n_rows, dtype=torch.float32, device=device)
    split_ops = torch.empty(split_rows.shape[0], ROW, dtype=torch.float32, device=device)
    hot_rows, hot_ops = [split_rows[:0]], [split_ops[:0]]
    block = -(-block // ROW) * ROW
    buf = torch.empty(min(block, n_rows * ROW), dtype=torch.float32, device=device)
    block_rows = torch.arange(0, n_rows + block // ROW, block // ROW, device=device)
    bounds = torch.searchsorted(split_rows, block_rows).tolist()  # split rows of each block
    for b, s in enumerate(range(0, n, block)):
        e = min(n, s + block)
        x = buf[: -(-(e - s) // ROW) * ROW]
        fill(s, e, x[: e - s])
        if x.shape[0] > e - s:
            x[e - s :] = 0.0  # the last row's padding
        rows, r0 = x.view(-1, ROW), s // ROW
        sums = torch.sum(rows, dim=1, out=row_sums[r0 : r0 + rows.shape[0]])
        k0, k1 = bounds[b], bounds[b + 1]
        if k1 > k0:
            split_ops[k0:k1] = rows[split_rows[k0:k1] - r0]
        if t < math.inf:
            candidates = torch.nonzero(sums >= t).squeeze(1)
            hot_rows.append(candidates + r0)
            hot_ops.append(rows[candidates])
    r, c = torch.nonzero(torch.cat(hot_ops) >= t, as_tuple=True)
    hot = torch.cat(hot_rows)[r] * ROW + c
    return row_sums, split_ops, hot[hot < n]


def _segment_starts(versions: Tensor, response_starts: Tensor) -> Tensor:
    """Sorted packed positions where a segment begins: a response begins or the version changes."""
    _, run_lengths = torch.unique_consecutive(versions, return_counts=True)
    changes = torch.cumsum(run_lengths, 0)[:-1]
    return torch.unique(torch.cat([response_starts, changes]))


def _segment_sums(row_sums: Tensor, split_rows: Tensor, split_ops: Tensor, starts: Tensor, n: int) -> Tensor:
    """Sum of D per segment in float64: whole rows by their row sum, split rows token by token."""
    if not starts.numel():
        return torch.zeros(0, dtype=torch.float64, device=starts.device)
    # Rows whose first token lies in segment i: ceil(starts[i] / ROW) <= row < ceil(starts[i+1] / ROW).
    first_row = -(-torch.cat([starts, starts.new_tensor([n])]) // ROW)
    whole = row_sums.double().index_fill_(0, split_rows, 0.0)
    sums = torch.segment_reduce(whole, "sum", lengths=torch.diff(first_row))
    # A split row's token belongs to the row's first segment plus the boundaries passed so far in the row.
    row_seg = torch.searchsorted(starts, split_rows * ROW, right=True) - 1
    inner = starts[starts % ROW != 0]
    is_start = torch.zeros(split_rows.shape[0], ROW, dtype=torch.long, device=starts.device)
    is_start[torch.searchsorted(split_rows, inner // ROW), inner % ROW] = 1
    token_seg = row_seg[:, None] + is_start.cumsum(1)
    return sums.index_add_(0, token_seg.flatten(), split_ops.flatten().double())


def _float32_at_least(x: float) -> float:
    """The smallest float32 >= x, so that comparing float32 D in float32 equals comparing D >= x exactly."""
    if x > float(np.finfo(np.float32).max):
        return math.inf
    t = np.float32(x)
    return float(t) if float(t) >= x else float(np.nextafter(t, np.float32(math.inf)))


# --- buffers and input checks -----------------------------------------------------------------------------


def _as_tensor(x: TensorLike, name: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _check_segments_input(versions: TensorLike, lengths: TensorLike, n: int, device) -> tuple[Tensor, Tensor]:
    v = _as_tensor(versions, "versions")
    if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool or v.shape != (n,):
        raise ValueError(f"versions must be a 1-D integer tensor [N={n}], got {v.dtype} {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"versions must be on the log-probs' device {device}, got {v.device}")
    if isinstance(lengths, (list, tuple)):
        lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
    lens = _as_tensor(lengths, "lengths")
    if lens.is_floating_point() or lens.is_complex() or lens.dtype == torch.bool or lens.dim() != 1:
        raise ValueError(f"lengths must be a 1-D integer tensor [R], got {lens.dtype} {tuple(lens.shape)}")
    lens = lens.to(device=device, dtype=torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got a negative length {int(lens.min())}")
    if int(lens.sum()) != n:
        raise ValueError(f"lengths must sum to the number of tokens N={n}, got {int(lens.sum())}")
    return v, lens


def _check_block(block: int | None, x: Tensor) -> int:
    """Tokens per streamed block: cache-sized on CPU; on an accelerator one block is fastest."""
    if block is None:
        return CPU_BLOCK if x.device.type == "cpu" else max(x.shape[0], 1)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive number of tokens, got {block!r}")
    return block


def _check_threshold(x: float, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating) or not x >= 0:
        raise ValueError(f"{name} must be a number >= 0 (math.inf turns the stage off), got {x!r}")
    return float(x)
