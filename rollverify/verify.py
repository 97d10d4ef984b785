"""Off-policy shift (OPS) and the two-stage verification of carried-over responses.

The inputs are *packed*: the generated tokens of R responses laid end to end in one 1-D tensor, with
``lengths[r]`` tokens for response r (``sum(lengths) == N``). For generated token j:

    D[j] = |exp(lp_new[j] - lp_old[j]) - 1|                     (float32; NaN/inf in either input -> inf)

Segments are maximal runs of equal policy version inside one response. Verification keeps a prefix:

    L1 = start of the first segment whose mean D >= d_s + seq_margin / sqrt(its length)   (else the whole response)
    L2 = index of the first token in [0, L1) with D >= d_t                                 (else L1)

and ``keep_lengths = L2``. An infinite threshold turns its stage off. ``seq_margin`` (default 0: the paper's
stage) raises a segment's threshold by a multiple of its mean's standard error, so that a short segment is cut
for its drift, not for one outlier token (rollverify/calibration.py sets it with ``d_s: auto``).

Everything is vectorised, and the packed inputs are read once: on CPU the tokens stream through in
cache-sized blocks, and per block the only per-token work is computing D, one sum per row of ``ROW``
tokens, and comparing each version with its predecessor (segment boundaries). Large CPU batches sum the
rows in one compiled kernel (torch.compile) that never writes D and takes it, where |lp_new - lp_old| <= 1/2,
from expm1's Taylor series (a few multiply-adds instead of an exponential); the few rows holding any other
difference are summed again from token_ops. The versions stay in the blocks, where numpy compares them
faster than the compiled integer code does. Segment sums and the token-stage search then touch only rows
that matter: the rows holding a segment boundary, and the rows whose sum reaches d_t (D >= 0, so a row
holding a token >= d_t has a row sum >= d_t).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

ROW = 64  # tokens per row of the two-level sum
CPU_BLOCK = 1 << 19  # tokens per streamed block on CPU (2 MiB of float32: stays in cache)
FUSED_MIN_TOKENS = 1 << 20  # CPU batches above this sum D's rows in one compiled kernel (_compiled_row_sums)
SERIES_RANGE = 0.5  # |lp_new - lp_old| up to which the compiled kernel takes D from expm1's Taylor series
SERIES_DEGREE = 8  # its truncation error there is below 1.1e-8 of D, its float32 rounding within 2 ulps
KERNEL_SLACK = 1.0 - 2.0**-20  # a kernel row sum is >= this times token_ops' D of any token in the row
_COMPILED: dict[Callable, Callable | None] = {}  # kernel D's function -> its compiled row sums (None: failed)

TensorLike = Tensor | np.ndarray
D_S, D_T = 0.01, 2.0  # the paper's thresholds: every default d_s / d_t (AlgoConfig's, RollVerify's) is these


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

    Taken as |expm1(lp_new - lp_old)|, exact to an ulp of D also where D is small (exp(x) - 1 in float32
    would lose all but a few bits of D ~ 1e-3 to the cancellation). Non-finite differences are mapped to
    +inf *before* expm1, so that lp_new = -inf (the new policy forbids the token) fails every check instead
    of landing on |0 - 1| = 1.
    """
    x = torch.sub(new_logprobs.float(), old_logprobs.float(), out=out)
    return _nonfinite_to_inf(x, out=x).expm1_().abs_()


def series_ops(old_logprobs: Tensor, new_logprobs: Tensor) -> Tensor:
    """token_ops' D where |lp_new - lp_old| <= SERIES_RANGE, from expm1's Taylor series to SERIES_DEGREE
    (within 2 ulps of D there, no exponential), and inf everywhere else (NaN and inf inputs included): the
    compiled kernel's D, whose infinite row sums mark the rows to sum again from token_ops."""
    x = new_logprobs.float() - old_logprobs.float()
    d = x * (1.0 / math.factorial(SERIES_DEGREE))
    for k in range(SERIES_DEGREE - 1, 0, -1):
        d = (d + 1.0 / math.factorial(k)) * x
    return torch.where(x.abs() <= SERIES_RANGE, d.abs(), math.inf)


def nan_to_inf(ops: Tensor, out: Tensor | None = None) -> Tensor:
    """Precomputed D (>= 0 or NaN) in float32 with NaN read as inf."""
    return _nonfinite_to_inf(ops.float(), out=out)


def _nonfinite_to_inf(x: Tensor, out: Tensor | None = None) -> Tensor:
    """NaN, -inf and +inf -> +inf. Under torch.compile written as a comparison (false for NaN and -inf), which
    inductor vectorises, where it does not vectorise isnan; eagerly one nan_to_num into ``out``."""
    if torch.compiler.is_compiling():
        return torch.where(x > -math.inf, x, math.inf)
    return torch.nan_to_num(x, nan=math.inf, posinf=math.inf, neginf=math.inf, out=out)


def two_stage_verify(
    old_logprobs: TensorLike,
    new_logprobs: TensorLike,
    versions: TensorLike,
    lengths: TensorLike,
    d_s: float = D_S,
    d_t: float = D_T,
    *,
    seq_margin: float = 0.0,
    block: int | None = None,
) -> VerifyResult:
    """Two-stage verification of packed responses; ``result.keep_lengths`` is the prefix to keep.

    old_logprobs: [N] the engine's log-prob of each generated token when it was sampled.
    new_logprobs: [N] the trainer's log-prob of the same token under the newly trained policy.
    versions:     [N] integer policy version that generated each token.
    lengths:      [R] integer token count per response, summing to N.
    d_s, d_t:     sequence- and token-level thresholds, >= 0; ``math.inf`` turns a stage off.
    seq_margin:   >= 0, finite: a segment of length l is cut when its mean D >= d_s + seq_margin / sqrt(l).
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
    seq_margin = _check_margin(seq_margin)
    block = _check_block(block, old)
    return _verify(_Source((old, new), token_ops, series_ops), versions, lengths, d_s, d_t, block, seq_margin)


def two_stage_verify_ops(
    ops: TensorLike,
    versions: TensorLike,
    lengths: TensorLike,
    d_s: float = D_S,
    d_t: float = D_T,
    *,
    seq_margin: float = 0.0,
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
    seq_margin = _check_margin(seq_margin)
    block = _check_block(block, d)
    return _verify(_Source((d,), nan_to_inf, nan_to_inf), versions, lengths, d_s, d_t, block, seq_margin)


# --- the algorithm ----------------------------------------------------------------------------------------


@dataclass
class _Source:
    """Where D comes from: ``fn(*inputs, out=None)`` on matching slices or rows of the packed inputs, and
    ``kernel(*inputs)``, the compiled kernel's D: fn's within a few ulps, or inf where it is costly to take."""

    inputs: tuple[Tensor, ...]
    fn: Callable[..., Tensor]
    kernel: Callable[..., Tensor]

    def block(self, s: int, e: int, out: Tensor) -> None:
        self.fn(*(x[s:e] for x in self.inputs), out=out)

    def rows(self, rows: Tensor) -> Tensor:
        """D of sorted whole rows [len(rows), ROW]; positions past the last token read as 0."""
        return self.fn(*(_gather_rows(x, rows) for x in self.inputs))


def _verify(ops: _Source, versions: Tensor, lengths: Tensor, d_s: float, d_t: float, block: int,
            seq_margin: float = 0.0) -> VerifyResult:
    """Both stages, reading D from ``ops``."""
    n = versions.shape[0]
    ends = torch.cumsum(lengths, 0)
    offsets = ends - lengths
    row_sums, version_changes = _scan(ops, versions, block)
    # A segment begins where a response begins or the version changes.
    starts = torch.unique(torch.cat([offsets[lengths > 0], version_changes]))
    seg_len = torch.diff(starts, append=starts.new_tensor([n]))
    seg_resp = torch.searchsorted(ends, starts, right=True)
    seg_sum = _segment_sums(ops, row_sums, starts)
    seg_mean = seg_sum / seg_len

    # Sequence stage: the first segment with mean D >= its threshold, and everything after it, is cut.
    keep1 = lengths.clone()
    if d_s < math.inf:
        bad = seg_mean >= (d_s + seq_margin * seg_len.double().rsqrt() if seq_margin else d_s)
        keep1.scatter_reduce_(0, seg_resp[bad], (starts - offsets[seg_resp])[bad], "amin")

    # Token stage: the first token in [0, L1) with D >= d_t, and everything after it, is cut.
    keep2 = keep1.clone()
    if d_t < math.inf:
        hot = _hot_tokens(ops, row_sums, _float32_at_least(d_t), n)
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


def _scan(ops: _Source, versions: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """The one pass over the packed inputs, in blocks of whole rows: the sum of D over each row of ROW
    tokens (the last row zero-padded), and the sorted positions j >= 1 where versions[j] != versions[j - 1].
    On CPU above FUSED_MIN_TOKENS the whole rows' sums come from one compiled kernel instead."""
    n = versions.shape[0]
    row_sums = torch.empty(-(-n // ROW), dtype=torch.float32, device=versions.device)
    summed = 0  # tokens [0, summed) have their rows summed
    if versions.device.type == "cpu" and n > FUSED_MIN_TOKENS:
        summed = _compiled_row_sums(ops, n // ROW * ROW, row_sums)
    block = -(-block // ROW) * ROW
    buf = torch.empty(min(block, -(-(n - summed) // ROW) * ROW), dtype=torch.float32, device=versions.device)
    changed = torch.empty(min(block, n), dtype=torch.bool, device=versions.device)
    changes = [versions.new_zeros(0, dtype=torch.int64)]
    for s in range(0, n, block):
        e = min(n, s + block)
        changes.append(_version_changes(versions, max(s, 1), e, changed))
        if e > summed:
            lo = max(s, summed)
            x = buf[: -(-(e - lo) // ROW) * ROW]
            ops.block(lo, e, out=x[: e - lo])
            if e - lo < x.shape[0]:
                x[e - lo :] = 0.0  # the last row's padding
            torch.sum(x.view(-1, ROW), dim=1, out=row_sums[lo // ROW : lo // ROW + x.shape[0] // ROW])
    return row_sums, torch.cat(changes)


def _compiled_row_sums(ops: _Source, m: int, row_sums: Tensor) -> int:
    """D summed over each row of tokens [0, m) (m a multiple of ROW) into ``row_sums`` by one compiled kernel
    (torch.compile) that reads the inputs once and never writes D, which the eager blocks do; when the kernel's
    D is not ``ops.fn``'s, the rows whose kernel sum is not finite are summed again from ``ops.fn``. Returns m,
    or 0 when compiling failed (no C++ compiler, say: a warning names why, and the eager blocks sum every row).
    Compiling takes seconds once per process, hence only for batches above FUSED_MIN_TOKENS."""
    fn = ops.kernel
    if fn not in _COMPILED:

        def sums(*inputs: Tensor) -> Tensor:
            return fn(*inputs).view(-1, ROW).sum(1)

        # "fast" lets the C++ compiler fuse the series' multiply-adds (inductor's default keeps them apart).
        _COMPILED[fn] = torch.compile(sums, dynamic=True, options={"cpp.enable_floating_point_contract_flag": "fast"})
    kernel = _COMPILED[fn]
    if kernel is None:
        return 0
    try:
        kernel_sums = kernel(*(x[:m] for x in ops.inputs))
    except Exception as e:  # an optimisation only: any failure to compile leaves the eager blocks
        warnings.warn(f"verification runs without its compiled pass ({type(e).__name__}: {e})", stacklevel=4)
        _COMPILED[fn] = None
        return 0
    if ops.kernel is not ops.fn:  # its inf marks the tokens it did not take; fn's own inf would stay inf
        again = torch.from_numpy(np.flatnonzero(~np.isfinite(kernel_sums.numpy())))  # numpy's are faster on CPU
        kernel_sums[again] = ops.rows(again).sum(1)
    row_sums[: m // ROW] = kernel_sums
    return m


def _version_changes(versions: Tensor, lo: int, e: int, scratch: Tensor) -> Tensor:
    """Sorted positions j in [lo, e) (lo >= 1) where versions[j] != versions[j - 1]; ``scratch`` is a bool
    buffer of at least e - lo flags.

    Changes are few: on CPU the flags are scanned eight at a time as 64-bit words (a bool is one byte, True
    is 1) and only the words holding a change are looked into, several times faster than flag by flag."""
    if versions.device.type != "cpu":
        return torch.nonzero(torch.ne(versions[lo:e], versions[lo - 1 : e - 1])).squeeze(1) + lo
    v, m = versions.numpy(), scratch.numpy()[: e - lo]
    np.not_equal(v[lo:e], v[lo - 1 : e - 1], out=m)
    w = m.shape[0] // 8 * 8
    words = np.flatnonzero(m[:w].view(np.uint64) != 0)  # numpy's nonzero is fast on bool, slow on integers
    r, c = np.nonzero(m[:w].reshape(-1, 8)[words])
    return torch.from_numpy(np.concatenate([words[r] * 8 + c, np.flatnonzero(m[w:]) + w]) + lo)


def _flatnonzero(mask: Tensor) -> Tensor:
    """Positions of the true entries of a 1-D bool tensor; on CPU by numpy, several times faster there."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


def _gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x in rows of ROW values, for sorted row indices: [len(rows), ROW], zero past the end of x."""
    n = x.shape[0]
    whole = n // ROW
    k = int(torch.searchsorted(rows, whole))  # rows[:k] lie inside x; rows[k] (if any) is the last, partial one
    out = x.new_zeros(rows.shape[0], ROW)
    out[:k] = x[: whole * ROW].view(whole, ROW).index_select(0, rows[:k])
    if k < rows.shape[0]:
        out[k, : n - whole * ROW] = x[whole * ROW :]
    return out


def _segment_sums(ops: _Source, row_sums: Tensor, starts: Tensor) -> Tensor:
    """Sum of D per segment in float64: whole rows by their row sum; rows a boundary splits, piece by piece."""
    if not starts.numel():
        return torch.zeros(0, dtype=torch.float64, device=starts.device)
    inner = starts[starts % ROW != 0]  # boundaries inside a row
    split = torch.unique_consecutive(inner // ROW)
    # Whole rows go to the segment holding their first token: rows ceil(s_i / ROW) .. ceil(s_i+1 / ROW) - 1.
    first_row = -(-torch.cat([starts, starts.new_tensor([row_sums.shape[0] * ROW])]) // ROW)
    whole = row_sums.double().index_fill_(0, split, 0.0)
    sums = torch.segment_reduce(whole, "sum", lengths=torch.diff(first_row))
    if not split.numel():
        return sums
    # Split rows, laid end to end, cut at their row ends and inner boundaries: each piece is in one segment.
    k = torch.arange(split.shape[0] + 1, device=starts.device) * ROW
    cuts = torch.unique(torch.cat([k, torch.searchsorted(split, inner // ROW) * ROW + inner % ROW]))
    piece_sums = torch.segment_reduce(ops.rows(split).flatten(), "sum", lengths=torch.diff(cuts))
    piece_first = split[cuts[:-1] // ROW] * ROW + cuts[:-1] % ROW
    piece_seg = torch.searchsorted(starts, piece_first, right=True) - 1
    return sums.index_add_(0, piece_seg, piece_sums.double())


def _hot_tokens(ops: _Source, row_sums: Tensor, t: float, n: int) -> Tensor:
    """Sorted positions of tokens with D >= t, searched in the rows whose sum reaches t (D >= 0), less the
    few ulps by which a kernel's row sum may fall short of token_ops' D."""
    rows = _flatnonzero(row_sums >= t * KERNEL_SLACK)
    r, c = torch.nonzero(ops.rows(rows) >= t, as_tuple=True)
    hot = rows[r] * ROW + c
    return hot[hot < n]


def _float32_at_least(x: float) -> float:
    """The smallest float32 >= x, so that comparing float32 D in float32 equals comparing D >= x exactly."""
    if x > float(np.finfo(np.float32).max):
        return math.inf
    t = np.float32(x)
    return float(t) if float(t) >= x else float(np.nextafter(t, np.float32(math.inf)))


# --- input checks -----------------------------------------------------------------------------------


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


def _check_margin(x: float) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating) or not 0 <= x < math.inf:
        raise ValueError(f"seq_margin must be a finite number >= 0 (0: no length correction), got {x!r}")
    return float(x)


def _check_threshold(x: float, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating) or not x >= 0:
        raise ValueError(f"{name} must be a number >= 0 (math.inf turns the stage off), got {x!r}")
    return float(x)
