"""Megatron-Core GPTModel for a Hugging Face Qwen3 / Qwen3-MoE checkpoint, and its packed forward.

`ModelArch` is read from the checkpoint's config.json (no weights touched) and is the single source of the
architecture; `build_model` maps it onto a TransformerConfig with the local (non-TransformerEngine) layer spec,
whose core attention is swapped for `attention.PackedCoreAttention` (linear memory in the sequence length; CPU
and GPU alike). `packed_forward` runs one micro-batch of several variable-length sequences packed end to end
(THD, `cu_seqlens`): attention stays inside each sequence and RoPE restarts at each, so every sequence sees
exactly what it would see alone (as in the engine).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class UnsupportedCheckpoint(ValueError):
    """The checkpoint's architecture or config is outside what the bridge converts."""


@dataclass(frozen=True)
class ModelArch:
    """What the bridge needs of a Qwen3 / Qwen3-MoE config (fields as in HF's config.json)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # YaRN RoPE scaling (HF rope_type "yarn"); yarn_factor 0: plain RoPE
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float = 1.0  # the factor on cos / sin (HF's attention_factor, resolved)
    yarn_truncate: bool = True

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def context_length(self) -> int:
        """Longest sequence the model is configured for (YaRN: factor x the original context, if longer)."""
        if self.yarn_factor:
            return max(self.max_position_embeddings,
                       int(self.yarn_factor * self.yarn_original_max_position_embeddings))
        return self.max_position_embeddings

    @staticmethod
    def from_hf_dir(path: str | Path) -> ModelArch:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
        return ModelArch.from_hf_config(json.loads(cfg_path.read_text()))

    @staticmethod
    def from_hf_config(cfg: dict) -> ModelArch:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedCheckpoint(
                f"unsupported architecture {arch!r} (model_type {cfg.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn", None):
            raise UnsupportedCheckpoint(f"RoPE scaling {rope} is not supported (default RoPE or YaRN)")
        if cfg.get("use_sliding_window"):
            raise UnsupportedCheckpoint("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        common = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            **(_yarn_fields(rope, cfg.get("max_position_embeddings", 4096)) if rope_type == "yarn" else {}),
        )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedCheckpoint(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if arch == "Qwen3MoeForCausalLM":
            if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                raise UnsupportedCheckpoint("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step "
                                            "!= 1) is not supported: every layer must be MoE")
            return ModelArch(
                **common,
                num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                top_k=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            )
        return ModelArch(**common)


def _yarn_fields(rope: dict, max_positions: int) -> dict:
    """ModelArch's YaRN fields from HF's rope parameters, with transformers' defaults and its attention factor."""
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise UnsupportedCheckpoint(f"YaRN RoPE {rope} has no original_max_position_embeddings")
    factor = rope.get("factor") or max_positions / original
    if factor < 1:
        raise UnsupportedCheckpoint(f"YaRN factor {factor} < 1 is not supported")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        def mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    if factor == 1 and attention_factor != 1:
        raise UnsupportedCheckpoint(f"YaRN with factor 1 and attention_factor {attention_factor} is not supported")
    return dict(yarn_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_attention_factor=float(attention_factor), yarn_truncate=bool(rope.get("truncate", True)))


RECOMPUTE = ("none", "selective", "full")


def recompute_options(recompute: str, moe: bool) -> dict:
    """TransformerConfig fields for an activation-recompute setting (see `transformer_config`)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "selective":
        return dict(recompute_granularity="selective",
                    recompute_modules=["core_attn"] if moe else ["core_attn", "mlp"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def check_layout(arch: ModelArch, *, tp: int = 1, ep: int = 1, pp: int = 1, cp: int = 1, etp: int = 1) -> None:
    """Refuse a parallel layout this model cannot be split into, naming every number that does not divide.

    Context parallelism splits every packed sequence (padded to a multiple of 2 * cp), so it needs nothing to
    divide; the trainer runs it for dense models only."""
    problems = []
    if cp > 1 and arch.moe:
        problems.append(f"cp={cp} is for dense models (context parallelism with MoE routing replay is not "
                        f"implemented): use cp=1 with {arch.architecture}")
    if arch.vocab_size % tp:
        problems.append(f"vocab_size {arch.vocab_size} is not divisible by tp={tp}")
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        problems.append(f"attention heads {arch.num_heads} / key-value heads {arch.num_kv_heads} are not both "
                        f"divisible by tp={tp}")
    if arch.moe and arch.num_experts % ep:
        problems.append(f"num_experts {arch.num_experts} is not divisible by ep={ep}")
    if not arch.moe and ep * etp > 1:
        problems.append(f"ep={ep} / etp={etp} need a MoE model ({arch.architecture} has no experts)")
    if arch.moe and arch.moe_intermediate_size % etp:
        problems.append(f"moe_intermediate_size {arch.moe_intermediate_size} is not divisible by etp={etp}")
    if arch.num_layers % pp:
        problems.append(f"num_layers {arch.num_layers} is not divisible by pp={pp}")
    if problems:
        raise UnsupportedCheckpoint(f"parallel layout tp={tp} ep={ep} pp={pp} cp={cp} etp={etp} cannot split this "
                                    f"{arch.architecture}: " + "; ".join(problems))


def transformer_config(arch: ModelArch, *, tp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1, cp: int = 1,
                       sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                       routing_replay: bool = True, dispatcher: str = "alltoall", init_weights: bool = False,
                       recompute: str = "none", paths=None):
    """TransformerConfig equivalent to `arch`. Fusions (fused RoPE, bias-SwiGLU) and MoE grouped GEMM follow
    `paths` (`megatron_bridge.throughput.ThroughputPaths`: Transformer Engine on CUDA); off without (they need
    TE or CUDA).

    recompute: "none"; "selective" (Megatron-Core's selective recompute of core attention, and of the MLP of a
    dense model); "full" (every layer keeps only its input and is recomputed in the backward).
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_layout(arch, tp=tp, ep=ep, pp=pp, cp=cp, etp=etp)
    kw = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=init_weights,  # normally the weights come from the checkpoint
        params_dtype=dtype,
        pipeline_dtype=dtype if pp > 1 else None,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        bias_activation_fusion=bool(paths and paths.fusions),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=bool(paths and paths.fusions),
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=pp > 1,  # packed rows differ in length; PP must communicate shapes
        moe_token_dispatcher_type=dispatcher,
        **recompute_options(recompute, arch.moe),
    )
    if arch.moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.top_k,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            # norm_topk_prob: softmax over the selected logits == softmax-all, top-k, renormalise (HF)
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=bool(paths and paths.grouped_gemm),
            moe_router_dtype="fp32",
            moe_enable_routing_replay=routing_replay,
            moe_permute_fusion=False,
        )
    config = TransformerConfig(**kw)
    # the packed attention's kernel (attention.PackedCoreAttention); not a TransformerConfig field
    config.rollverify_attention = paths.attention if paths is not None else "sdpa"
    if arch.yarn_factor:
        # read by GPTModel (position_embedding_type="yarn") and by attention's cos / sin scale; not dataclass
        # fields in Megatron-Core 0.16.1. The concentration factor there is mscale(f, m) / mscale(f, 0) =
        # 0.1 m ln f + 1, so m is chosen to give HF's attention factor.
        f = arch.yarn_factor
        config.yarn_rotary_scaling_factor = f
        config.yarn_original_max_position_embeddings = arch.yarn_original_max_position_embeddings
        config.yarn_beta_fast = arch.yarn_beta_fast
        config.yarn_beta_slow = arch.yarn_beta_slow
        config.yarn_mscale = (arch.yarn_attention_factor - 1.0) / (0.1 * math.log(f)) if f > 1 else 0.0
        config.yarn_mscale_all_dim = 0.0
        config.yarn_correction_range_round_to_int = arch.yarn_truncate
    return config


def build_model(arch: ModelArch, config, *, pre_process: bool | None = None, post_process: bool | None = None):
    """A GPTModel for `arch` on this rank's pipeline stage (weights uninitialised): Transformer Engine's layer
    spec when `config` asks for TE fusions (`transformer_config(paths=...)`), else the local spec with the
    project's norms; the packed core attention in both."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_bridge.attention import PackedCoreAttention, SequenceParallelRMSNorm

    # RouterReplay keeps a process-wide list of instances in construction order; a new model starts afresh.
    RouterReplay.clear_global_router_replay_instances()
    te = config.apply_rope_fusion  # set with the TE paths only (transformer_config)
    if te:
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=arch.num_experts or None,
                                                          moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=True)
        final_norm = TENorm
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(num_experts=arch.num_experts or None, moe_grouped_gemm=False,
                                        qk_layernorm=True, normalization="RMSNorm")
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
        layer.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
        layer.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
        final_norm = SequenceParallelRMSNorm
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=final_norm)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="yarn" if arch.yarn_factor else "rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    if not config.perform_initialization:
        mark_tensor_parallel(model)
    if torch.cuda.is_available() and not _cpu_only():
        model.cuda(torch.cuda.current_device())
    return model


# Megatron-Core 0.16.1's Transformer Engine layers (megatron/core/extensions/transformer_engine.py) that split their
# weights over TP, by class name (the module imports TE, so the names are read without it) -> the split dimension:
# parallel_mode "column" splits the output (0), "row" the input (1). TE tags its own weights; these fill a gap.
TE_PARALLEL_DIMS = {"TEColumnParallelLinear": 0, "TELayerNormColumnParallelLinear": 0, "TERowParallelLinear": 1,
                    "TEColumnParallelGroupedLinear": 0, "TERowParallelGroupedLinear": 1}


def mark_tensor_parallel(model) -> None:
    """Tag TP-split weights as Megatron-Core's initialisers would (`tensor_model_parallel`, partition dim).

    With `perform_initialization=False` (weights come from a checkpoint) Megatron-Core 0.16.1 never sets these
    attributes, and then the optimizer counts every split weight as a TP duplicate: the grad norm (and so the
    clipping) would use TP rank 0's shards only.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        dim = 1 if isinstance(module, RowParallelLinear) else TE_PARALLEL_DIMS.get(type(module).__name__, 0)
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) or \
                type(module).__name__ in TE_PARALLEL_DIMS:
            # a grouped linear layer (experts) holds weight0 .. weight{n-1}
            weights = [getattr(module, "weight", None)] + [getattr(module, f"weight{i}", None)
                                                          for i in range(getattr(module, "num_gemms", 0))]
            for w in weights:
                if w is not None and not getattr(w, "tensor_model_parallel", False):
                    set_tensor_model_parallel_attributes(w, True, dim, 1)


def _cpu_only() -> bool:
    from megatron_bridge import cpu_compat

    return cpu_compat.is_active()


@dataclass
class PackedSequences:
    """Variable-length sequences packed end to end into one row of T tokens (THD layout).

    `cu_seqlens` delimits the sequences; attention (`attention.PackedCoreAttention`) is causal inside each and
    nothing crosses a boundary, and RoPE restarts at 0 for each (Megatron-Core's THD RoPE path), so every
    sequence sees exactly what it would see alone. Padding to a multiple (for sequence parallelism) is one
    more segment at the end. Under context parallelism every segment is padded at its end to a multiple of
    2 * cp (tokens after a sequence's last one change nothing before them) and split by `context_parallel_index`.
    Nothing here is quadratic in T.
    """

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64: position inside its own sequence
    cu_seqlens: torch.Tensor  # [n + 1 (+1 with padding)] int32: segment boundaries, padding included
    lengths: list[int]  # the n real sequences
    places: list[tuple[int, int]]  # per sequence: (row = 0, start column)

    @staticmethod
    def pack(sequences: list[torch.Tensor], pad_to_multiple: int = 1, segment_multiple: int = 1) -> PackedSequences:
        """Pack end to end; each segment padded to a multiple of `segment_multiple`, the pack to one of
        `pad_to_multiple` (which `segment_multiple` must divide)."""
        lengths = [int(x.numel()) for x in sequences]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packing needs >= 1 sequence of >= 1 token, got lengths {lengths}")
        if pad_to_multiple % segment_multiple:
            raise ValueError(f"pad_to_multiple {pad_to_multiple} is not a multiple of segment_multiple "
                             f"{segment_multiple}")
        starts = np.cumsum([0, *(n + (-n) % segment_multiple for n in lengths)]).tolist()
        total = starts[-1]
        pad = (-total) % pad_to_multiple
        bounds = starts + ([total + pad] if pad else [])
        ids = torch.zeros(1, total + pad, dtype=torch.long)
        for x, st in zip(sequences, starts, strict=False):
            ids[0, st:st + x.numel()] = x.long().view(-1)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]).view(1, -1)
        return PackedSequences(ids, pos, torch.tensor(bounds, dtype=torch.int32), lengths,
                               [(0, st) for st in starts[:-1]])

    def context_parallel_index(self, cp: int, rank: int) -> torch.Tensor:
        """Positions of the pack that context-parallel rank `rank` of `cp` holds, in its order: of every
        segment, chunks `rank` and `2 * cp - 1 - rank` of 2 * cp equal chunks (Megatron-Core's causal load
        balance, which its THD RoPE assumes)."""
        bounds = self.cu_seqlens.tolist()
        out = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if (b - a) % (2 * cp):
                raise ValueError(f"a segment of {b - a} tokens does not split into 2 * cp = {2 * cp} chunks")
            c = (b - a) // (2 * cp)
            out += [torch.arange(a + rank * c, a + (rank + 1) * c),
                    torch.arange(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c)]
        return torch.cat(out)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def seq_params(self, device: torch.device | str = "cpu"):
        """Megatron-Core's `PackedSeqParams` for this pack (THD, self-attention), with the boundaries also as
        Python ints (`host_bounds`), so that attention never reads them back from the device."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device)
        bounds = tuple(self.cu_seqlens.tolist())  # the pack is built on the host: no device read
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        params.host_bounds = bounds  # not a PackedSeqParams field: read by attention.PackedCoreAttention
        return params

    def flat_rows(self, i: int, offset: int, count: int) -> torch.Tensor:
        """Indices into the flattened [T] tokens of tokens offset..offset+count-1 of sequence i."""
        return self.places[i][1] + offset + torch.arange(count)


def packed_forward(model, batch: PackedSequences, device: torch.device | str = "cpu",
                   tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The model's output [1, T, ...] for a pack: logits [1, T, vocab/tp] (this TP rank's vocab slice), or
    hidden states [1, T, hidden] when the output layer is deferred (`logprobs.defer_output_layer`).
    Under context parallelism `tokens` are this rank's positions (`context_parallel_index`) and the output
    covers those only; the sequence boundaries stay the whole pack's."""
    ids, pos = batch.input_ids, batch.position_ids
    if tokens is not None:
        ids, pos = ids[:, tokens], pos[:, tokens]
    return model(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=None,
                 packed_seq_params=batch.seq_params(device))


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
