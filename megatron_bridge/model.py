"""Megatron-Core GPTModel for a Hugging Face Qwen3 / Qwen3-MoE checkpoint, and its packed forward.

`ModelArch` is read from the checkpoint's config.json (no weights touched) and is the single source of the
architecture; `build_model` maps it onto a TransformerConfig with the local (non-TransformerEngine) layer spec,
which runs on CPU and GPU alike. `packed_forward` runs one micro-batch of several variable-length sequences
packed into one row: a block-diagonal causal mask keeps the sequences apart and RoPE takes each token's
position inside its own sequence, so every sequence sees exactly what it would see alone (as in the engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

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
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise UnsupportedCheckpoint(f"RoPE scaling {rope} is not supported (only default RoPE)")
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

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers if self.moe else 0


def transformer_config(arch: ModelArch, *, tp: int = 1, ep: int = 1, pp: int = 1, etp: int = 1,
                       sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                       routing_replay: bool = True, dispatcher: str = "alltoall", init_weights: bool = False):
    """TransformerConfig equivalent to `arch` (fusions off: they need TE/apex or CUDA)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if arch.vocab_size % tp:
        raise UnsupportedCheckpoint(f"vocab_size {arch.vocab_size} is not divisible by tp={tp}")
    if arch.num_kv_heads % tp or arch.num_heads % tp:
        raise UnsupportedCheckpoint(f"heads {arch.num_heads}/{arch.num_kv_heads} not divisible by tp={tp}")
    if arch.moe and arch.num_experts % ep:
        raise UnsupportedCheckpoint(f"num_experts {arch.num_experts} not divisible by ep={ep}")
    if arch.num_layers % pp:
        raise UnsupportedCheckpoint(f"num_layers {arch.num_layers} not divisible by pp={pp}")
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
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=init_weights,  # normally the weights come from the checkpoint
        params_dtype=dtype,
        pipeline_dtype=dtype if pp > 1 else None,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        variable_seq_lengths=pp > 1,  # packed rows differ in length; PP must communicate shapes
        moe_token_dispatcher_type=dispatcher,
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
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_enable_routing_replay=routing_replay,
            moe_permute_fusion=False,
        )
    return TransformerConfig(**kw)


class PackedRotary(torch.nn.Module):
    """RoPE by each token's own position (packed rows), delegating everything else to Megatron's module.

    Megatron-Core's 'rope' uses positions 0..S-1 of the row; for a packed row that would shift every sequence
    but the first, which is exact in theory (RoPE is relative) but not in fp32 at large offsets. Setting
    `position_ids` ([B, S]) before a forward makes the embeddings the per-token ones ([S, B, 1, dim]) instead.
    """

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base
        self.position_ids: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.base.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.position_ids is None:
            return self.base(max_seq_len, offset, packed_seq, cp_group)
        pos = self.position_ids.view(-1, self.position_ids.shape[-1])  # [B, S]
        emb = self.base.get_emb(int(pos.max()) + 1)[:, 0, 0]  # [P, dim]
        return emb[pos.t().to(emb.device)].unsqueeze(2)  # [S, B, 1, dim], broadcast over heads


def build_model(arch: ModelArch, config, *, pre_process: bool | None = None, post_process: bool | None = None):
    """A GPTModel with the local layer spec for `arch` on this rank's pipeline stage (weights uninitialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # RouterReplay keeps a process-wide list of instances in construction order; a new model starts afresh.
    RouterReplay.clear_global_router_replay_instances()
    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    if not config.perform_initialization:
        mark_tensor_parallel(model)
    if getattr(model, "rotary_pos_emb", None) is not None:
        model.rotary_pos_emb = PackedRotary(model.rotary_pos_emb)
    if torch.cuda.is_available() and not _cpu_only():
        model.cuda(torch.cuda.current_device())
    return model


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
        dim = 1 if isinstance(module, RowParallelLinear) else 0
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            w = getattr(module, "weight", None)
            if w is not None and not getattr(w, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(w, True, dim, 1)


def _cpu_only() -> bool:
    from megatron_bridge import cpu_compat

    return cpu_compat.is_active()


@dataclass
class PackedBatch:
    """Variable-length sequences packed end to end into B rows of S tokens (a sequence never splits).

    Rows bound the dense attention of the local spec (its cost grows with S^2, not with the sequences'
    lengths): sequences fill a row in order until `row_tokens`, a longer sequence gets a row of its own, and
    rows are padded to a common S with padding that attends only to itself.
    """

    input_ids: torch.Tensor  # [B, S] int64
    position_ids: torch.Tensor  # [B, S] int64: position inside its own sequence
    seq_index: torch.Tensor  # [B, S] int64: which sequence (in pack order), -1 on padding
    lengths: list[int]
    places: list[tuple[int, int]]  # per sequence: (row, start column)

    @staticmethod
    def pack(sequences: list[torch.Tensor], pad_to_multiple: int = 1, row_tokens: int | None = None) -> PackedBatch:
        lengths = [int(x.numel()) for x in sequences]
        cap = max([row_tokens or sum(lengths), *lengths, 1])
        places, row, used = [], 0, 0
        for n in lengths:
            if used and used + n > cap:
                row, used = row + 1, 0
            places.append((row, used))
            used += n
        rows = row + 1
        width = max([1] + [st + n for (_, st), n in zip(places, lengths, strict=True)])
        width += (-width) % pad_to_multiple
        ids = torch.zeros(rows, width, dtype=torch.long)
        pos = torch.arange(width).repeat(rows, 1)
        idx = torch.full((rows, width), -1, dtype=torch.long)
        for i, (x, (r, st), n) in enumerate(zip(sequences, places, lengths, strict=True)):
            ids[r, st:st + n] = x.long().view(-1)
            pos[r, st:st + n] = torch.arange(n)
            idx[r, st:st + n] = i
        for r in range(rows):  # padding positions count from 0 after the row's last sequence
            pad = idx[r] < 0
            pos[r, pad] = torch.arange(int(pad.sum()))
        return PackedBatch(ids, pos, idx, lengths, places)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def attention_mask(self) -> torch.Tensor:
        """[B, 1, S, S] bool, True = masked: causal inside each sequence, nothing across (padding apart)."""
        b, s = self.input_ids.shape
        seg = self.seq_index.clone()
        seg[seg < 0] = len(self.lengths)  # padding forms one more causal segment
        same = seg.unsqueeze(2) == seg.unsqueeze(1)
        causal = torch.ones(s, s, dtype=torch.bool).tril_()
        return ~(same & causal).view(b, 1, s, s)

    def flat_rows(self, i: int, offset: int, count: int) -> torch.Tensor:
        """Indices into the [B*S] (row-major) flattening of tokens offset..offset+count-1 of sequence i."""
        r, st = self.places[i]
        return r * self.input_ids.shape[1] + st + offset + torch.arange(count)


def packed_forward(model, batch: PackedBatch, device: torch.device | str = "cpu") -> torch.Tensor:
    """Logits [B, S, vocab/tp] of the packed rows (this TP rank's vocab slice)."""
    inner = unwrap(model)
    rotary = getattr(inner, "rotary_pos_emb", None)
    if isinstance(rotary, PackedRotary):
        rotary.position_ids = batch.position_ids.to(device)
    try:
        return model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                     attention_mask=batch.attention_mask().to(device))
    finally:
        if isinstance(rotary, PackedRotary):
            rotary.position_ids = None


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
