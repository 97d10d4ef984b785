"""Per-token Python reference of the two-stage verification, written straight from DESIGN.md.

Deliberately naive (plain loops over responses, segments and tokens), and never on the training path: the
vectorised code in rollverify.verify is tested against it (tests/test_verify.py), and tools/bench_verify.py
times it.
"""

from __future__ import annotations

import math

import numpy as np


def reference_token_ops(old: float, new: float) -> float:
    """D = |exp(lp_new - lp_old) - 1| of the float32 log-probs, rounded to float32; a NaN or inf in either
    input gives inf."""
    old32, new32 = np.float32(old), np.float32(new)
    if not (math.isfinite(old32) and math.isfinite(new32)):
        return math.inf
    x = float(new32 - old32)  # float32 subtraction, exact as a float64
    if not math.isfinite(x):  # the difference overflowed float32
        return math.inf
    with np.errstate(over="ignore"):
        return float(np.float32(abs(math.expm1(min(x, 100.0)))))  # float32 overflow gives inf


def reference_verify_ops(
    ops: list[float], versions: list[int], lengths: list[int], d_s: float, d_t: float
) -> list[int]:
    """Keep length per response from per-token OPS D (NaN counts as inf)."""
    keep, pos = [], 0
    for n in lengths:
        d = [math.inf if math.isnan(x) else float(x) for x in ops[pos : pos + n]]
        v = list(versions[pos : pos + n])
        pos += n
        # Segments: maximal runs of equal version, in order.
        segments, start = [], 0
        for j in range(1, n + 1):
            if j == n or v[j] != v[start]:
                segments.append((start, j))
                start = j
        # Sequence stage: cut at the first segment whose mean D >= d_s.
        l1 = n
        if d_s != math.inf:
            for a, b in segments:
                if sum(d[a:b]) / (b - a) >= d_s:
                    l1 = a
                    break
        # Token stage: cut at the first token in [0, L1) whose D >= d_t.
        l2 = l1
        if d_t != math.inf:
            for j in range(l1):
                if d[j] >= d_t:
                    l2 = j
                    break
        keep.append(l2)
    return keep


def reference_verify(
    old: list[float], new: list[float], versions: list[int], lengths: list[int], d_s: float, d_t: float
) -> list[int]:
    """Keep length per response from the engine's and the trainer's log-probs."""
    ops = [reference_token_ops(o, w) for o, w in zip(old, new, strict=True)]
    return reference_verify_ops(ops, versions, lengths, d_s, d_t)


def reference_verify_sources(
    old: list[float], new: list[float], versions: list[int], sources: list[int], lengths: list[int], d_s: float,
    d_t: float,
) -> list[int]:
    """Keep length per whole response whose tokens are of two sources (0 policy, 1 environment): the
    verification reads the policy tokens only, as if the environment tokens were not there; a cut at policy
    token k keeps the tokens before it (environment tokens among them), keeping every policy token keeps the
    whole response."""
    keep, pos = [], 0
    for n in lengths:
        idx = [pos + j for j in range(n) if sources[pos + j] == 0]
        k = reference_verify([old[i] for i in idx], [new[i] for i in idx], [versions[i] for i in idx], [len(idx)],
                             d_s, d_t)[0]
        keep.append(n if k == len(idx) else idx[k] - pos)
        pos += n
    return keep
