"""The rollout side's environment: a sandboxed Python interpreter, tool calls in the chat template's format, a
bounded concurrent tool runner, and a code-execution reward. Engine-agnostic: standard library and rollverify core
only (nothing from sglang_ext, megatron_bridge or the application)."""
