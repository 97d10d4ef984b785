"""Where every input of `rollverify simulate` comes from. Nothing in the model has been measured on a GPU: each
input is a vendor's figure, the model's shape, read from SGLang's source, the paper's setting, the project's
algorithm configuration, a resolution of the simulation, or set by hand (guessed). simulate.json carries the
label of every input (`inputs`) and the list of guessed ones (`guessed_inputs`); docs/cost_model.md has the
same table.
"""

from __future__ import annotations

from typing import Any

KINDS = {
    "vendor": "a vendor's published figure",
    "model": "the model's architecture (Qwen3-8B's config.json)",
    "sglang": "read from SGLang 0.5.23's source (its defaults and constants)",
    "paper": "the paper's setting (Table 7: 32 H800, batch 128 x 8, 500 iterations)",
    "algorithm": "the project's algorithm configuration (rollverify.strategies.AlgoConfig)",
    "resolution": "a resolution of the simulation, not a property of the system",
    "guessed": "set by hand: not measured, chosen to be plausible (or to fit the paper's ratios)",
    "fitted": "learnt from a real run's metrics (--tools-from)",
}

# dotted config key (or a prefix ending in '.') -> (kind, note); the first match wins
RULES: tuple[tuple[str, str, str], ...] = (
    ("gpu_spec.", "vendor", "peak dense bf16 FLOP/s, HBM bandwidth, memory as the driver reports it"),
    ("model.", "model", "parameters, layers, heads, head dim, dtypes"),
    ("cluster.gpu", "paper", "H800"),
    ("cluster.gpus", "paper", "32 GPUs"),
    ("cluster.tp", "guessed", "the paper does not give its servers' tp"),
    ("cluster.mem_fraction_static", "sglang", "None: SGLang's own choice for the GPU (memory_hook.py)"),
    ("cluster.max_total_tokens", "sglang", "SGLang's cap on the KV pool; None: its profiled size"),
    ("cluster.resident_gib", "guessed", "CUDA contexts on a colocated GPU (rollverify/app/gpu_memory.py, unmeasured)"),
    ("cluster.", "guessed", "achieved bandwidth and MFUs, decode overhead, hand-over and sync"),
    ("workload.token_unit", "resolution", "real tokens per simulated token"),
    ("workload.context", "paper", "the context limit of each run"),
    ("workload.", "guessed", "response lengths: log-normal median, spreads, growth with the limit; not DAPO-Math"),
    ("drift.", "guessed", "how the policies drift apart: scale, growth, collapse point, what it grows with"),
    ("tools.max_calls", "guessed", "0: single-turn"),
    ("tools.", "guessed", "tool calls per trajectory and their latency"),
    ("algo.", "algorithm", "thresholds, switch, staleness bound: the real strategies' defaults"),
    ("batch_groups", "paper", "128 prompts"),
    ("n", "paper", "8 responses each"),
    ("paper_steps", "paper", "500 iterations"),
    ("steps", "resolution", "simulated steps standing for paper_steps"),
    ("seed", "resolution", "the draw of lengths and drift"),
    ("max_live_batches", "guessed", "responses in flight in the carry-over modes"),
    ("rollout_gpus", "resolution", "0: searched over every split"),
    ("split_candidates", "resolution", "empty: every split"),
    ("async_", "guessed", "the asynchronous schedule's pause, trainer overhead and CUDA context"),
    ("sglang.", "sglang", "scheduler constants: new_token_ratio, its decay, the clip of max_new_tokens"),
    ("floors.", "guessed", "the floors' bandwidth fraction, MFU and decode batch"),
    ("drift_variants", "resolution", "the drifts every headline ratio is shown under"),
    ("poll_s", "guessed", "how often the loop sees finishes (1 s)"),
)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def label(key: str, fitted_tools: bool = False) -> tuple[str, str]:
    if fitted_tools and key.startswith("tools."):
        return "fitted", "learnt from the run given to --tools-from"
    for rule, kind, note in RULES:
        if key == rule or (rule.endswith(".") and key.startswith(rule)) or (rule.endswith("_") and key.startswith(rule)):
            return kind, note
    return "unlabelled", ""


def inputs(config: dict, fitted_tools: bool = False) -> list[dict]:
    """Every input in `config` (simulate.json's "config") with where it comes from."""
    rows = []
    for key, value in _flatten(config).items():
        kind, note = label(key, fitted_tools)
        rows.append(dict(key=key, value=value, kind=kind, guessed=kind == "guessed", note=note))
    return rows
