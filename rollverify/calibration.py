"""Drift by age, and verification thresholds set from it (``algo.d_s: auto``, ``algo.d_t: auto``).

A threshold on OPS means something only relative to how far one policy version drifts: the same d_s = 0.01 is
idle at a small learning rate and cuts everything at a large one. Verification already holds what it takes to
measure that drift: the token OPS D of every carried token and the version that sampled it. Checked against
version k, a token sampled by version v is ``age = k - v`` versions old.

**Drift by age** (`drift_stats`, every verification, under ``verify/drift/``): for ages 1, 2 and 3+ (and 0, the
same-version engine/trainer floor, where a schedule verifies tokens of the current version): the token OPS'
mean over its finite values, its quantiles 0.5 / 0.9 / 0.99 / 0.999, token and non-finite counts; the segment
means' mean and median, segment count and mean length. ``verify/whatif/ds_<x>`` is the acceptance the sequence
stage alone would give at each d_s of `D_S_GRID`, read from the same segment means (no extra forward).

**Thresholds** (`AutoThresholds`), from the one-version drift of the last `WINDOW` verifications (each with at
least `MIN_TOKENS` one-version tokens; the median over them, so one odd step does not move them):

    delta1     = mean D of one-version-old tokens: the mean a long one-version segment has
    d_s        = floor + C_SEQ * delta1
    seq_margin = Z_LENGTH * sigma1        a segment of length l is cut at mean D >= d_s + seq_margin / sqrt(l)
    d_t        = the D_T_QUANTILE quantile of one-version token OPS

where ``floor`` is the same-version engine/trainer mismatch (the trainer's ``mismatch_ops_mean``, handed over by
the loop after each optimizer step, or the mean D of the verified batch's own current-version tokens where it has
at least MIN_TOKENS of them, as the asynchronous schedule's may; 0 until measured) and ``sigma1`` the standard deviation of one-version token OPS,
each token capped at their D_T_QUANTILE quantile (a token above it is an outlier, the token stage's to cut).

Why C_SEQ = 2 (docs/verification.md has the whole derivation): the paper gives acceptance 0.2 at d_s = 0.005 and
acceptance high enough at 0.01 that the switch fires only near iteration 400 of 500. Its segments are thousands of
tokens long, so their means are tight: the segments that decide a cut sit at ~0.5-0.65 of 0.01, and d_s is
1.5-2x the drift it judges. The deciding segment is a carried response's oldest, at least one version old, so
relative to one version the factor is at least that: C_SEQ = 2, the upper end. With drift growing as a random walk
(sqrt(age)) it also puts the threshold at a segment four versions old, the paper's span of pi_k .. pi_{k-3}.

Why a margin for length: the paper's segments are thousands of tokens, these may be a few; a few tokens' mean
is dominated by one outlier (carried OPS is heavy-tailed), and without it the sequence stage is an outlier
filter whose pass rate swings with segment length, not a drift threshold. With Z_LENGTH = 2 a segment is cut
when its mean exceeds d_s by two standard errors of a one-version segment of its length; at the paper's lengths
the margin vanishes.

**Warm-up**: until one verification has measured `MIN_TOKENS` one-version tokens (normally the first: everything
carried after step 1 is one version old) the sequence stage is off and the token stage runs at `WARMUP_D_T`, the
paper's absolute d_t; thresholds are set from the batch they then verify, its one-version tokens included. The
estimates are the strategy's state: a checkpoint keeps them (`to_state`, `from_state`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from rollverify.verify import D_S, D_T, VerifyResult

AUTO = "auto"
C_SEQ = 2.0  # d_s = floor + C_SEQ * one-version drift (the paper's operating point, above)
Z_LENGTH = 2.0  # standard errors of a one-version segment's mean above d_s before a segment is cut
D_T_QUANTILE = 0.999  # d_t: this quantile of one-version token OPS
WINDOW = 5  # verifications whose estimates are pooled (median)
MIN_TOKENS = 64  # one-version tokens a verification needs for its estimate to count
WARMUP_D_T = D_T  # the token stage's threshold before any drift is measured (the paper's)
MIN_THRESHOLD = 1e-6  # auto thresholds never go below it (float32 log-probs' rounding: D of identical weights)

AGE_BUCKETS = ("age0", "age1", "age2", "age3p")  # same version (floor), 1, 2, and 3 or more versions old
QUANTILES = (0.5, 0.9, 0.99, 0.999)
D_S_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # the what-if acceptance curve's d_s
DRIFT_PREFIX = "drift/"  # under the strategy's stats (the loop adds verify/)
WHATIF_PREFIX = "whatif/"


def grid_key(d_s: float) -> str:
    """``ds_1e-02``: the what-if key of one d_s of the grid."""
    return f"ds_{d_s:.0e}"


def _quantile_key(q: float) -> str:
    return "p" + f"{q * 100:g}".replace(".", "")  # 0.5 -> p50, 0.999 -> p999


def drift_stats(ops: Tensor, versions: Tensor, segments: VerifyResult, version: int) -> dict[str, float]:
    """Drift by age of one verification: per age bucket, token OPS and segment means (keys in the module doc);
    and the sequence stage's what-if acceptance over `D_S_GRID`. ``ops`` [N] the token OPS of the policy tokens,
    ``versions`` [N] their versions, ``segments`` the verification's result over them (its segments, lengths),
    ``version`` the policy checked against. Every key is always there (rollverify/metrics.py's rule): a bucket
    without tokens has counts 0 and NaN statistics, and the what-if curve over no tokens is NaN."""
    out: dict[str, float] = {}
    age = (version - versions.long()).clamp(min=0, max=3)
    d = ops.double().nan_to_num(nan=math.inf, posinf=math.inf)  # NaN counts as inf, as in verification
    seg_age = (version - segments.segment_versions).clamp(min=0, max=3)
    for a, name in enumerate(AGE_BUCKETS):
        sel = age == a
        n = int(sel.sum())
        p = f"{DRIFT_PREFIX}{name}_"
        if not n:
            out.update(_empty_bucket(p))
            continue
        x = d[sel]
        finite = x[torch.isfinite(x)]
        out[p + "tokens"] = float(n)
        out[p + "nonfinite"] = float(n - finite.numel())
        out[p + "ops_mean"] = float(finite.mean()) if finite.numel() else math.nan
        qs = _quantiles(x, QUANTILES)
        out.update({p + "ops_" + _quantile_key(q): float(v) for q, v in zip(QUANTILES, qs, strict=True)})
        seg = segments.segment_mean_ops[seg_age == a]
        seg_len = segments.segment_lengths[seg_age == a]
        seg_finite = seg[torch.isfinite(seg)]
        out[p + "segments"] = float(seg.numel())
        out[p + "seg_len_mean"] = float(seg_len.double().mean())
        out[p + "seg_mean"] = float(seg_finite.mean()) if seg_finite.numel() else math.nan
        out[p + "seg_p50"] = float(_quantiles(seg, (0.5,))[0])
    acc = whatif_acceptance(segments, D_S_GRID).tolist() if ops.numel() else [math.nan] * len(D_S_GRID)
    out.update({f"{WHATIF_PREFIX}{grid_key(g)}": float(v) for g, v in zip(D_S_GRID, acc, strict=True)})
    return out


def empty_drift_stats() -> dict[str, float]:
    """`drift_stats`' keys where nothing was verified (or no OPS computed): counts 0, statistics NaN."""
    out: dict[str, float] = {}
    for name in AGE_BUCKETS:
        out.update(_empty_bucket(f"{DRIFT_PREFIX}{name}_"))
    out.update({f"{WHATIF_PREFIX}{grid_key(g)}": math.nan for g in D_S_GRID})
    return out


def _empty_bucket(p: str) -> dict[str, float]:
    nan = math.nan
    return {p + "tokens": 0.0, p + "nonfinite": 0.0, p + "ops_mean": nan,
            **{p + "ops_" + _quantile_key(q): nan for q in QUANTILES},
            p + "segments": 0.0, p + "seg_len_mean": nan, p + "seg_mean": nan, p + "seg_p50": nan}


def _quantiles(x: Tensor, qs: tuple[float, ...]) -> list[float]:
    """Quantiles that are values of ``x`` (numpy's inverted_cdf: the smallest value whose share of values at or
    below it is >= q; no interpolation, so inf sorts last and a quantile that reaches it is inf), by one sort on
    ``x``'s device."""
    n = x.numel()
    values = torch.sort(x.reshape(-1)).values
    return [float(values[max(math.ceil(n * q) - 1, 0)]) for q in qs]


def whatif_acceptance(segments: VerifyResult, grid: tuple[float, ...] | list[float]) -> Tensor:
    """[G] the acceptance (kept / verified tokens) the sequence stage alone would give at each d_s of ``grid``,
    from the verification's segment means: per d_s, each response is kept up to the start of its first segment
    whose mean is >= d_s. 1.0 where nothing was verified."""
    lengths = segments.lengths
    total = int(lengths.sum())
    g = torch.tensor(list(grid), dtype=torch.float64, device=lengths.device)
    if not total:
        return torch.ones_like(g)
    offsets = torch.cumsum(lengths, 0) - lengths
    rel = segments.segment_starts - offsets[segments.segment_response]  # [S] segment start within its response
    bad = segments.segment_mean_ops.unsqueeze(0) >= g.unsqueeze(1)  # [G, S]
    big = torch.iinfo(torch.int64).max
    pos = torch.where(bad, rel.unsqueeze(0), big)
    first = torch.full((g.numel(), lengths.numel()), big, dtype=torch.int64, device=lengths.device)
    first.scatter_reduce_(1, segments.segment_response.unsqueeze(0).expand_as(pos), pos, "amin")
    keep = torch.minimum(first, lengths.unsqueeze(0))
    return keep.sum(1).double() / total


@dataclass
class OneVersion:
    """What one verification measured of its one-version-old tokens."""

    delta1: float  # mean token OPS (finite values)
    q_t: float  # the D_T_QUANTILE quantile of token OPS
    sigma: float  # standard deviation of token OPS capped at q_t
    tokens: int

    @classmethod
    def measure(cls, ops: Tensor, versions: Tensor, version: int) -> OneVersion | None:
        """The one-version tokens' figures, or None when there are fewer than MIN_TOKENS of them."""
        x = ops[(version - versions.long()) == 1].double()
        if x.numel() < MIN_TOKENS:
            return None
        finite = x[torch.isfinite(x)]
        if not finite.numel():
            return None
        q_t = _quantiles(finite, (D_T_QUANTILE,))[0]  # a non-finite token fails any finite d_t
        capped = finite.clamp(max=q_t)
        return cls(delta1=float(finite.mean()), q_t=q_t, sigma=float(capped.std(unbiased=False)), tokens=int(x.numel()))


@dataclass
class Thresholds:
    """What one verification runs with: ``d_s``, ``d_t`` (inf: stage off), ``seq_margin`` (verify.py)."""

    d_s: float
    d_t: float
    seq_margin: float = 0.0
    warmup: bool = False


@dataclass
class AutoThresholds:
    """Sets d_s and/or d_t every verification from the measured drift (module doc); a threshold given as a
    number stays that number. ``history`` holds the last WINDOW verifications' `OneVersion` figures."""

    auto_s: bool = True
    auto_t: bool = True
    d_s: float = D_S  # used when not auto_s
    d_t: float = D_T  # used when not auto_t
    floor: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    measured: int = 0  # verifications that measured enough one-version tokens, over the run

    def observe_floor(self, mismatch_ops_mean: float | None) -> None:
        """The same-version engine/trainer mismatch of the latest optimizer step (ignored when not finite)."""
        if mismatch_ops_mean is not None and math.isfinite(mismatch_ops_mean) and mismatch_ops_mean >= 0:
            self.floor = float(mismatch_ops_mean)

    def update(self, ops: Tensor, versions: Tensor, version: int) -> Thresholds:
        """Add this verification's one-version drift (when it has enough) and return its thresholds."""
        same = ops[versions.long() == version].double()  # a schedule that verifies current-version tokens
        same = same[torch.isfinite(same)]
        if same.numel() >= MIN_TOKENS:
            self.floor = float(same.mean())
        one = OneVersion.measure(ops, versions, version)
        if one is not None:
            self.history = [*self.history, asdict(one)][-WINDOW:]
            self.measured += 1
        return self.thresholds()

    def thresholds(self) -> Thresholds:
        if not self.history:  # warm-up: no drift measured yet
            return Thresholds(math.inf if self.auto_s else self.d_s, WARMUP_D_T if self.auto_t else self.d_t,
                              warmup=True)
        delta1 = statistics.median(h["delta1"] for h in self.history)
        d_t = max(statistics.median(h["q_t"] for h in self.history), MIN_THRESHOLD) if self.auto_t else self.d_t
        if not self.auto_s:
            return Thresholds(self.d_s, d_t)
        sigma1 = statistics.median(h["sigma"] for h in self.history)
        return Thresholds(max(self.floor + C_SEQ * delta1, MIN_THRESHOLD), d_t, Z_LENGTH * sigma1)

    def stats(self, used: Thresholds) -> dict[str, float]:
        """The thresholds a verification ran with and what they came from (under the strategy's stats)."""
        out = {"d_s": used.d_s, "d_t": used.d_t, "seq_margin": used.seq_margin, "auto_warmup": float(used.warmup),
               "auto_floor": self.floor}
        if self.history:
            out["auto_delta1"] = statistics.median(h["delta1"] for h in self.history)
        return out

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AutoThresholds:
        return cls(**state)


def parse_threshold(value: Any, key: str) -> float | str:
    """A threshold setting: a number >= 0 (inf turns the stage off) or "auto"; ValueError naming the key."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"algo.{key} must be a number >= 0 (inf turns the stage off) or \"auto\" (set from the "
                         f"measured drift, docs/verification.md), got {value!r}")
    return float(value)
