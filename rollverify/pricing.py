"""The priced cost of a rollout: one figure per step that a GPU's time would follow, in decode iterations.

Decode iterations alone (``decode_iters``: the rollout phase's sequential engine iterations) price a phase as if
every token in a batch were free, which on a GPU they are only until the batch is compute-bound, and they ignore
prefill. A mode that cuts and regenerates much, or re-prefills many long carried responses after every weight
update, can look cheap in iterations and not be. The priced figure adds what those cost:

    priced iterations = decode_iters + tokens_generated / DECODE_TOKENS_PER_ITER
                                     + prefill_tokens / PREFILL_TOKENS_PER_ITER

from three fields of every step record (rollverify/loop.py): ``decode_iters``, ``tokens_generated`` (every policy
token the phase produced, regenerated ones included) and ``prefill_tokens`` (prompt and prefix tokens the engines
prefilled for launches, resumes after a weight update, and resubmissions). Each decode iteration costs one read
of the weights; each generated token adds its matmuls, ``DECODE_TOKENS_PER_ITER`` of which take as long as that
read; each prefilled token costs a prefill's matmuls, ``PREFILL_TOKENS_PER_ITER`` of which take one iteration's
time. Both ratios come from the simulator's GPU-time model (rollverify/sim/cost.py: Qwen3-8B in bf16 on an
H800-class GPU at its default efficiencies) and are guesses, not measurements: they set how much a token weighs
against an iteration, not which mode does more work. The sum is an upper bound of the roofline (an iteration
costs the larger of its weight read and its compute, not both), the KV cache's reads are left out and every
response's prompt is counted whole (no prefix sharing). docs/verification.md defines it for the docs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollverify.sim.cost import GPUS, ClusterSpec, CostModel, ModelSpec

FIELDS = ("decode_iters", "tokens_generated", "prefill_tokens")  # the step-record fields the figure reads


@dataclass(frozen=True)
class Prices:
    """Tokens that cost one decode iteration's time: generated (their matmuls) and prefilled."""

    decode_tokens_per_iter: float
    prefill_tokens_per_iter: float

    @classmethod
    def of(cls, cost: CostModel) -> Prices:
        """From a GPU-time model: one memory-bound decode iteration of a single sequence, against one token's
        matmuls at the decode and at the prefill efficiency."""
        gpu = GPUS[cost.cluster.gpu]
        flops_per_token = 2 * cost.model.params
        iteration = float(cost.decode_iteration(1, 0))
        decode_token = flops_per_token / (gpu.peak_flops * cost.cluster.mfu_decode * cost.cluster.tp)
        return cls(iteration / decode_token, iteration / cost.prefill(1))


PRICES = Prices.of(CostModel(ModelSpec(), ClusterSpec()))


def priced_iterations(decode_iters: float, tokens_generated: float, prefill_tokens: float,
                      prices: Prices = PRICES) -> float:
    """One step's priced cost in decode-iteration equivalents (module doc)."""
    return (decode_iters + tokens_generated / prices.decode_tokens_per_iter
            + prefill_tokens / prices.prefill_tokens_per_iter)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def run_cost(records: Sequence[Mapping[str, Any]], ledger: Mapping[str, Any] | None = None,
             prices: Prices = PRICES) -> dict[str, float | None]:
    """A run's cost figures from its step records (and its ledger, summary.json's ``ledger``): per step the
    means of decode iterations, generated and prefilled tokens and the priced figure, the priced figure's
    standard error over the steps, and generated tokens per trained token. ``priced`` is None where a step
    lacks one of `FIELDS` (a record from before prefill was counted)."""
    rows = [r for r in records if _num(r.get("decode_iters")) is not None]
    out: dict[str, float | None] = {}
    for key in FIELDS:
        vals = [v for r in rows if (v := _num(r.get(key))) is not None]
        out[key] = statistics.fmean(vals) if vals else None
    priced = [priced_iterations(*(float(r[k]) for k in FIELDS), prices=prices) for r in rows
              if all(_num(r.get(k)) is not None for k in FIELDS)]
    complete = rows and len(priced) == len(rows)
    out["priced"] = statistics.fmean(priced) if complete else None
    out["priced_se"] = statistics.stdev(priced) / math.sqrt(len(priced)) if complete and len(priced) > 1 else None
    generated = _num((ledger or {}).get("generated_tokens"))
    trained = _num((ledger or {}).get("trained_tokens"))
    out["generated_per_trained"] = generated / trained if generated is not None and trained else None
    return out
