"""The physical floor of a workload: the GPU-days no schedule can beat on this cluster, beside which every table
of `rollverify simulate` prints the modes.

Computed from the workload alone (every response at its drawn length, as on-policy generates them, nothing cut,
nothing carried):

* decode is bound by HBM reads: every generated token reads the KV of its whole context (prompt and the tokens
  before it) and its share of the weights at a decode batch of ``decode_batch`` sequences, at ``bw_fraction``
  of the GPU's peak bandwidth;
* training runs at ``mfu`` of peak, linear layers and causal attention at each sequence's length: the
  old-log-prob forward, then the forward and backward of the step (three forwards' FLOPs);
* perfect overlap: every GPU of the cluster is busy with one or the other all the time (no prefill, no
  hand-over, no weight sync, no tail, no verification beyond the old-log-prob pass it reuses).

GPU-days = (decode + training GPU-seconds of a step) x paper_steps / 86400.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollverify.sim.cost import GpuSpec, ModelSpec
from rollverify.sim.engine import Workload


@dataclass(frozen=True)
class FloorSpec:
    """The assumptions of one floor (hand-set: the best a GPU has been seen to do, not measured here)."""

    bw_fraction: float  # of peak HBM bandwidth achieved by decode
    mfu: float  # of peak FLOP/s achieved by training, attention included
    decode_batch: int = 64  # sequences sharing one read of the weights

    @property
    def name(self) -> str:
        return f"floor_bw{round(self.bw_fraction * 100)}_mfu{round(self.mfu * 100)}"

    @property
    def assumptions(self) -> str:
        return (f"decode bound by KV and weight reads at {self.bw_fraction:.0%} of peak HBM bandwidth (batch "
                f"{self.decode_batch}), training at MFU {self.mfu:g} incl. causal attention (old-log-prob forward + "
                "forward + backward), perfect overlap on every GPU")


FLOORS = (FloorSpec(1.0, 0.5), FloorSpec(0.75, 0.4))


def response_lengths(workload: Workload, seed: int, groups: int, n: int) -> np.ndarray:
    """Generated real tokens of responses (group g, index i) for g < groups, i < n: the lengths they reach uncut."""
    return np.array([workload.units(seed, g, i) * workload.token_unit for g in range(groups) for i in range(n)],
                    dtype=np.float64)


def physical_floor(model: ModelSpec, gpu: GpuSpec, gpus: int, workload: Workload, lengths: np.ndarray, steps: int,
                   paper_steps: int, spec: FloorSpec) -> dict:
    """The floor of `steps` steps whose responses generate `lengths` tokens (all steps together)."""
    prompt = float(workload.prompt_tokens)
    kv = model.kv_bytes_per_token
    # token j of a response reads the KV of prompt + j tokens: sum over j < L is P L + L (L - 1) / 2
    kv_read = kv * float((prompt * lengths + lengths * (lengths - 1) / 2).sum())
    weights_read = model.weight_bytes / spec.decode_batch * float(lengths.sum())
    decode_gpu_s = (kv_read + weights_read) / (gpu.hbm_bytes_per_s * spec.bw_fraction) / steps
    train_gpu_s = 4 * model.forward_flops(prompt + lengths) / (gpu.peak_flops * spec.mfu) / steps
    step_gpu_s = decode_gpu_s + train_gpu_s
    generated = float(lengths.sum()) / steps
    return dict(
        name=spec.name, bw_fraction=spec.bw_fraction, mfu=spec.mfu, decode_batch=spec.decode_batch,
        assumptions=spec.assumptions,
        gpu_days=step_gpu_s * paper_steps / 86400.0, step_s=step_gpu_s / gpus,
        decode_gpu_s_per_step=decode_gpu_s, train_gpu_s_per_step=train_gpu_s,
        generated_tokens_per_step=generated,
        kv_bytes_read_per_token=kv_read / float(lengths.sum()),
    )


def floors(model: ModelSpec, gpu: GpuSpec, gpus: int, workload: Workload, seed: int, batch_groups: int, n: int,
           steps: int, paper_steps: int, specs: tuple[FloorSpec, ...] = FLOORS) -> list[dict]:
    lengths = response_lengths(workload, seed, batch_groups * steps, n)
    return [physical_floor(model, gpu, gpus, workload, lengths, steps, paper_steps, s) for s in specs]
