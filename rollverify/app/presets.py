"""What ships by name: model architectures (`model.arch`), so that `rollverify plan` sizes the paper's models
without their checkpoints, and the run configs (`--config NAME`). Nothing here imports more than the standard
library, so `rollverify --help` can list them at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The configs shipped with the package: rollverify/configs (in a checkout, a link to configs/ at its root).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> list[str]:
    """The names of the shipped configs (`--config NAME`), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


# Architectures stated as the fields of their Hugging Face config.json (checked against the published files and
# slime's Megatron argument scripts), so `plan` can size the paper's models without their checkpoints.
ARCH_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
}
