"""Stand-in for `sgl_kernel.mamba`: imported by SGLang's linear-attention backend, never called for Qwen3."""


def chunk_gated_delta_rule_cpu(*args, **kwargs):
    raise NotImplementedError("sgl_kernel.mamba.chunk_gated_delta_rule_cpu: linear attention is not supported on CPU")
