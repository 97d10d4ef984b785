"""How far `rollverify simulate`'s verdicts rest on the drift model, which is set by hand: every headline ratio
again under other drifts (`DriftModel.late`, the collapse point, and `driver`, what the drift grows with), and
which conclusions hold under all of them.

Only the verified modes depend on the drift (on_policy, partial and async_partial never compute a new log-prob),
so a variant re-runs rollverify and async_rollverify (the latter at the split the main run chose) and reuses the
others' runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rollverify.sim.engine import DRIFT_DRIVERS, DriftModel

# The paper's Table 7 (Qwen3-8B-Base, 32 H800, batch 128 x 8, 500 iterations): GPU-days on_policy, rollverify.
PAPER_TABLE7 = {8192: (16.6, 15.1), 32768: (98.1, 57.5), 65536: (261.0, 137.0)}
DRIFT_MODES = ("rollverify", "rollverify_tb", "async_rollverify", "async_rollverify_tb")  # the modes whose cost depends on the drift
# besides the default (progress, late 0.85): the collapse earlier and later, and drift driven by off-policy training
DEFAULT_VARIANTS = (("progress", 0.80), ("progress", 0.90), ("progress", 0.95), ("offpolicy", 0.85))


def parse_variant(spec: str) -> tuple[str, float]:
    """``driver:late``, e.g. ``progress:0.9`` or ``offpolicy:0.85``."""
    driver, _, late = spec.partition(":")
    try:
        value = float(late)
    except ValueError:
        raise ValueError(f"--drift-variants {spec!r}: give DRIVER:LATE, e.g. progress:0.9 or offpolicy:0.85") from None
    if driver not in DRIFT_DRIVERS or not 0 < value <= 1.5:
        raise ValueError(f"--drift-variants {spec!r}: DRIVER is one of {DRIFT_DRIVERS}, LATE in (0, 1.5]")
    return driver, value


def variants(base: DriftModel, specs: Sequence[tuple[str, float]]) -> list[DriftModel]:
    """The base drift first, then each variant of it that differs from it."""
    out = [base]
    for driver, late in specs:
        d = replace(base, driver=driver, late=late)
        if d not in out:
            out.append(d)
    return out


def ratios(by_mode: dict[str, dict], floors: Sequence[dict] = ()) -> dict:
    """The headline ratios of one context under one drift: each mode / on_policy, async_rollverify / rollverify,
    and the floors / on_policy."""
    on = by_mode.get("on_policy")
    row: dict = {}
    for mode, r in by_mode.items():
        row[f"{mode}_gpu_days"] = r["gpu_days"]
        row[f"{mode}_switched_at"] = r["switched_at"]
        if on is not None:
            row[f"{mode}_ratio"] = r["gpu_days"] / on["gpu_days"]
    if "async_rollverify" in by_mode and "rollverify" in by_mode:
        row["async_rollverify_vs_rollverify"] = by_mode["async_rollverify"]["gpu_days"] / by_mode["rollverify"]["gpu_days"]
    for f in floors:
        if on is not None:
            row[f"{f['name']}_ratio"] = f["gpu_days"] / on["gpu_days"]
    return row


@dataclass(frozen=True)
class Claim:
    text: str
    holds: Callable[[dict, int], bool | None]  # (a ratios row, its context) -> verdict, None: cannot be judged


def _get(row: dict, key: str) -> float:
    v = row.get(key)
    return math.nan if v is None else float(v)


def _cmp(key: str, op: str, bound: float | str) -> Callable[[dict, int], bool | None]:
    def holds(row: dict, context: int) -> bool | None:
        a = _get(row, key)
        b = _get(row, bound) if isinstance(bound, str) else float(bound)
        if not (math.isfinite(a) and math.isfinite(b)):
            return None
        return a < b if op == "<" else a <= b

    return holds


def _within_paper(row: dict, context: int) -> bool | None:
    r = _get(row, "rollverify_ratio")
    if context not in PAPER_TABLE7 or not math.isfinite(r):
        return None
    on, rv = PAPER_TABLE7[context]
    return abs(r / (rv / on) - 1) <= 0.15


def _keeps_half(row: dict, context: int) -> bool | None:
    rv, partial = _get(row, "rollverify_ratio"), _get(row, "partial_ratio")
    if not (math.isfinite(rv) and math.isfinite(partial)) or partial >= 1:
        return None
    return 1 - rv >= 0.5 * (1 - partial)


CLAIMS = (
    Claim("rollverify costs less than on_policy", _cmp("rollverify_ratio", "<", 1.0)),
    Claim("rollverify is within 15 % of the paper's ratio", _within_paper),
    Claim("rollverify keeps at least half of partial's saving", _keeps_half),
    Claim("async_rollverify costs less than on_policy", _cmp("async_rollverify_ratio", "<", 1.0)),
    Claim("async_rollverify costs less than colocated rollverify", _cmp("async_rollverify_ratio", "<", "rollverify_ratio")),
    Claim("async_rollverify <= 0.50x of on_policy (the target)", _cmp("async_rollverify_ratio", "<=", 0.5)),
    Claim("on_policy with tail batching costs less than on_policy", _cmp("on_policy_tb_ratio", "<", 1.0)),
    Claim("rollverify with a tail-batched fallback <= 0.55x of on_policy (the target)",
          _cmp("rollverify_tb_ratio", "<=", 0.55)),
)


def conclusions(sensitivity: dict[str, dict[str, dict]]) -> list[dict]:
    """Each claim per context: under which drifts it holds and under which it fails ("survives" when it holds
    under every one judged). ``sensitivity``: context -> drift label -> ratios row."""
    out = []
    for claim in CLAIMS:
        for context, by_drift in sensitivity.items():
            verdicts = {label: claim.holds(row, int(context)) for label, row in by_drift.items()}
            judged = {k: v for k, v in verdicts.items() if v is not None}
            if not judged:
                continue
            holds = [k for k, v in judged.items() if v]
            fails = [k for k, v in judged.items() if not v]
            out.append(dict(claim=claim.text, context=int(context), holds_under=holds, fails_under=fails,
                            verdict="survives the range" if not fails else
                            "fails under every drift" if not holds else "depends on the drift"))
    return out


def table(sensitivity: dict[str, dict[str, dict]], floor_name: str | None = None) -> str:
    head = (f"{'drift (what it grows with, collapse point)':<30}{'context':>8}{'rv/on':>8}{'switch':>8}"
            f"{'async_rv/on':>13}{'switch':>8}{'async_rv/rv':>13}{'partial/on':>12}{'async_part/on':>15}"
            + f"{'on_tb/on':>10}{'rv_tb/on':>10}{'switch':>8}" + (f"{'floor/on':>10}" if floor_name else ""))
    lines = [head, "-" * len(head)]
    for context, by_drift in sensitivity.items():
        for label, row in by_drift.items():
            def f(key: str, fmt: str = ".3f", row: dict = row) -> str:
                v = row.get(key)
                return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)
            lines.append(
                f"{label:<30}{int(context) // 1024:>7}K{f('rollverify_ratio'):>8}{f('rollverify_switched_at', 'd'):>8}"
                f"{f('async_rollverify_ratio'):>13}{f('async_rollverify_switched_at', 'd'):>8}"
                f"{f('async_rollverify_vs_rollverify'):>13}{f('partial_ratio'):>12}{f('async_partial_ratio'):>15}"
                f"{f('on_policy_tb_ratio'):>10}{f('rollverify_tb_ratio'):>10}{f('rollverify_tb_switched_at', 'd'):>8}"
                + (f"{f(f'{floor_name}_ratio'):>10}" if floor_name else ""))
    return "\n".join(lines)


def conclusions_text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        tail = "" if not r["fails_under"] or not r["holds_under"] else f" (fails under: {', '.join(r['fails_under'])})"
        lines.append(f"  {r['context'] // 1024:>3}K  {r['claim']}: {r['verdict']}{tail}")
    return "\n".join(lines)
