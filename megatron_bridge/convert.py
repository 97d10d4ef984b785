"""Hugging Face <-> Megatron-Core weights for Qwen3 / Qwen3-MoE, sharded for TP, EP and PP, tensor by tensor.

One table (`_entries`) lists every weight of the architecture once, in a fixed global order, with its HF
name(s), its Megatron-Core name and how it is split across ranks:

* `rep`  replicated (norms, router);
* `row0` split along dim 0 over TP (vocab-parallel embedding and output layer);
* `row1` split along dim 1 over TP (row-parallel `linear_proj`, `linear_fc2`);
* `qkv`  q/k/v fused per query group `[q heads of group g, k_g, v_g]` and split by groups over TP;
* `glu`  gate/up fused as `[gate shard, up shard]` per TP rank.

Experts live on the EP rank that owns them, split over the expert-TP group like their dense counterparts
(`glu` / `row1`; whole with etp = 1); layers on the pipeline stage that owns them.

Loading reads only this rank's slice of each tensor (`safe_open(...).get_slice`), so no rank ever holds a second
full copy of the model, and checks every shape against the config before the first copy: a bad checkpoint
fails naming the tensor and leaves the model untouched. Export walks the same table and assembles one HF
tensor at a time with collectives inside the TP, EP and PP groups (every rank must iterate; every rank gets
the full tensor), so the peak extra memory is one tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_bridge.model import ModelArch, UnsupportedCheckpoint, unwrap


class CheckpointMismatch(ValueError):
    """A tensor of the checkpoint is missing or has a shape its config does not allow."""


@dataclass(frozen=True)
class Entry:
    """One Megatron-Core weight and the HF tensor(s) it is made of."""

    mcore: str  # Megatron name with the *global* layer index and *global* expert index
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str  # rep | row0 | row1 | qkv | glu
    layer: int | None = None  # global layer index (None: embedding / final norm / output layer)
    expert: int | None = None  # global expert index
    stage: str = "layer"  # "first" (embedding), "last" (final norm, output layer) or "layer"


def _entries(arch: ModelArch) -> list[Entry]:
    h, hd, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    out = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                 ((arch.vocab_size, h),), "row0", stage="first")]
    for i in range(arch.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.append(Entry(m + "input_layernorm.weight", (p + "input_layernorm.weight",), ((h,),), "rep", i))
        out.append(Entry(m + "self_attention.linear_qkv.weight",
                         tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
                         ((nq * hd, h), (nkv * hd, h), (nkv * hd, h)), "qkv", i))
        if arch.attention_bias:
            out.append(Entry(m + "self_attention.linear_qkv.bias",
                             tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"),
                             ((nq * hd,), (nkv * hd,), (nkv * hd,)), "qkv", i))
        out.append(Entry(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",),
                         ((h, nq * hd),), "row1", i))
        out.append(Entry(m + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",), ((hd,),),
                         "rep", i))
        out.append(Entry(m + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",), ((hd,),),
                         "rep", i))
        out.append(Entry(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), ((h,),),
                         "rep", i))
        if arch.moe:
            e_ff = arch.moe_intermediate_size
            out.append(Entry(m + "mlp.router.weight", (p + "mlp.gate.weight",), ((arch.num_experts, h),),
                             "rep", i))
            for e in range(arch.num_experts):
                q = f"{p}mlp.experts.{e}."
                me = f"{m}mlp.experts.local_experts.{e}."
                out.append(Entry(me + "linear_fc1.weight", (q + "gate_proj.weight", q + "up_proj.weight"),
                                 ((e_ff, h), (e_ff, h)), "glu", i, e))
                out.append(Entry(me + "linear_fc2.weight", (q + "down_proj.weight",), ((h, e_ff),), "row1", i, e))
        else:
            ff = arch.intermediate_size
            out.append(Entry(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                             ((ff, h), (ff, h)), "glu", i))
            out.append(Entry(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), ((h, ff),), "row1", i))
    out.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), ((h,),), "rep", stage="last"))
    if not arch.tie_word_embeddings:
        out.append(Entry("output_layer.weight", ("lm_head.weight",), ((arch.vocab_size, h),), "row0",
                         stage="last"))
    return out


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every HF tensor name of the architecture in export order."""
    return [n for e in _entries(arch) for n in e.hf]


@dataclass(frozen=True)
class Layout:
    """Where this rank sits; derived from parallel_state (or given, for tests)."""

    tp: int
    tp_rank: int
    ep: int
    ep_rank: int
    pp: int
    pp_rank: int
    etp: int = 1
    etp_rank: int = 0

    @staticmethod
    def current() -> Layout:
        from megatron.core import parallel_state as ps

        return Layout(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                      ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                      ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                      ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())


def _stage_of(entry: Entry, arch: ModelArch, pp: int) -> int:
    if entry.stage == "first":
        return 0
    if entry.stage == "last":
        return pp - 1
    return entry.layer // (arch.num_layers // pp)


def _local_name(entry: Entry, arch: ModelArch, lay: Layout) -> str | None:
    """This rank's Megatron parameter name for `entry`, or None if the rank holds no part of it."""
    if _stage_of(entry, arch, lay.pp) != lay.pp_rank:
        return None
    name = entry.mcore
    if entry.layer is not None:
        per_stage = arch.num_layers // lay.pp
        name = name.replace(f"decoder.layers.{entry.layer}.", f"decoder.layers.{entry.layer % per_stage}.", 1)
    if entry.expert is not None:
        per_rank = arch.num_experts // lay.ep
        if entry.expert // per_rank != lay.ep_rank:
            return None
        name = name.replace(f"local_experts.{entry.expert}.", f"local_experts.{entry.expert % per_rank}.", 1)
    return name


def _tp_split(entry: Entry, lay: Layout) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel split of this entry: TP, or expert TP for experts."""
    if entry.kind == "rep":
        return 1, 0
    if entry.expert is not None:
        return lay.etp, lay.etp_rank
    return lay.tp, lay.tp_rank


# Transformer Engine's layer spec (megatron_bridge.throughput) names some parameters differently from the local
# spec this table uses: the norm before a linear layer is fused into it, and grouped experts are one module
_TE_NAMES = (
    (re.compile(r"^(decoder\.layers\.\d+\.)input_layernorm\.weight$"), r"\1self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"^(decoder\.layers\.\d+\.)pre_mlp_layernorm\.weight$"), r"\1mlp.linear_fc1.layer_norm_weight"),
    (re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$"),
     r"\1\3.weight\2"),
)


def te_name(name: str) -> str:
    """The Transformer Engine layer spec's name of local-spec parameter `name` (the same where nothing is fused)."""
    for pattern, repl in _TE_NAMES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


class Params(dict):
    """A model's named parameters, looked up by local-spec name whichever spec built the model."""

    def key(self, name: str) -> str:
        if dict.__contains__(self, name):
            return name
        other = te_name(name)
        return other if dict.__contains__(self, other) else name

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, self.key(name))

    def __getitem__(self, name: str):
        return dict.__getitem__(self, self.key(name))


# ----------------------------------------------------------------------------------------------- loading


class _Reader:
    """Lazy access to a (possibly multi-file) safetensors checkpoint: shapes from headers, slices on demand."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path} has no *.safetensors files")
            weight_map = None
        self._handles = {f: safe_open(str(path / f), "pt", device="cpu") for f in files}
        self.where: dict[str, str] = {}
        for f, h in self._handles.items():
            for k in h.keys():
                if weight_map is None or weight_map.get(k) == f:
                    self.where[k] = f

    def shape(self, name: str) -> tuple[int, ...] | None:
        f = self.where.get(name)
        return None if f is None else tuple(self._handles[f].get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handles[self.where[name]].get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handles[self.where[name]].get_slice(name)[:, start:stop]

    def full(self, name: str) -> torch.Tensor:
        return self._handles[self.where[name]].get_tensor(name)


def _read_shard(entry: Entry, reader: _Reader, arch: ModelArch, lay: Layout, hf_names: tuple[str, ...]):
    tp, r = _tp_split(entry, lay)
    k = entry.kind
    if k == "rep" or (tp == 1 and k in ("row0", "row1")):
        return reader.full(hf_names[0])
    if k == "row0":
        n = entry.hf_shapes[0][0] // tp
        return reader.rows(hf_names[0], r * n, (r + 1) * n)
    if k == "row1":
        n = entry.hf_shapes[0][1] // tp
        return reader.cols(hf_names[0], r * n, (r + 1) * n)
    if k == "glu":
        n = entry.hf_shapes[0][0] // tp
        return torch.cat([reader.rows(x, r * n, (r + 1) * n) for x in hf_names])
    if k == "qkv":
        hd = arch.head_dim
        groups = arch.num_kv_heads // tp
        qpg = arch.num_heads // arch.num_kv_heads
        g0 = r * groups
        q = reader.rows(hf_names[0], g0 * qpg * hd, (g0 + groups) * qpg * hd)
        kk = reader.rows(hf_names[1], g0 * hd, (g0 + groups) * hd)
        v = reader.rows(hf_names[2], g0 * hd, (g0 + groups) * hd)
        tail = q.shape[1:]
        parts = [q.reshape(groups, qpg * hd, *tail), kk.reshape(groups, hd, *tail), v.reshape(groups, hd, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)
    raise AssertionError(k)


def check_checkpoint(path: str | Path, arch: ModelArch | None = None) -> ModelArch:
    """Validate a checkpoint against its own config without reading any weight; returns its architecture."""
    path = Path(path)
    arch = arch or ModelArch.from_hf_dir(path)
    reader = _Reader(path)
    _check_shapes(reader, arch, path)
    return arch


def _hf_names_for(entry: Entry, arch: ModelArch, reader: _Reader) -> tuple[str, ...]:
    # a tied output layer on a later pipeline stage is loaded from the embedding
    if entry.mcore == "output_layer.weight" and arch.tie_word_embeddings:
        return ("model.embed_tokens.weight",)
    return entry.hf


def _check_shapes(reader: _Reader, arch: ModelArch, path: Path) -> None:
    problems = []
    for e in _entries(arch):
        for name, want in zip(e.hf, e.hf_shapes, strict=True):
            got = reader.shape(name)
            if got is None:
                problems.append(f"{name}: missing")
            elif got != want:
                problems.append(f"{name}: shape {list(got)}, config implies {list(want)}")
    if problems:
        raise CheckpointMismatch(f"checkpoint {path} does not match its config.json ({arch.architecture}): "
                                 + "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more"
                                                               if len(problems) > 8 else ""))


@torch.no_grad()
def load_hf_checkpoint(model, path: str | Path, arch: ModelArch | None = None, layout: Layout | None = None) -> int:
    """Copy an HF checkpoint into this rank's shard of `model`; returns the number of parameters filled.

    All shapes are checked first (and every parameter of the model must be covered), so on any error the model
    is left exactly as it was.
    """
    path = Path(path)
    arch = arch or ModelArch.from_hf_dir(path)
    lay = layout or Layout.current()
    model = unwrap(model)
    reader = _Reader(path)
    _check_shapes(reader, arch, path)
    params = Params(model.named_parameters())
    plan = []
    for e in _entries(arch):
        local = _local_name(e, arch, lay)
        if local is None and e.stage == "first" and arch.tie_word_embeddings and "output_layer.weight" in params:
            # a tied output layer on the last stage (pp > 1) is a copy of the embedding
            plan.append(("output_layer.weight", e))
        if local is None:
            continue
        if local not in params:
            raise UnsupportedCheckpoint(f"model has no parameter {local} for {e.hf}: bridge/model mismatch")
        plan.append((local, e))
    missing = set(params) - {params.key(name) for name, _ in plan}
    if missing:
        raise UnsupportedCheckpoint(f"no checkpoint tensor maps to model parameters {sorted(missing)[:5]}")
    for local, e in plan:  # every shape before the first copy
        want = _shard_shape(e, arch, lay)
        if want != tuple(params[local].shape):
            raise UnsupportedCheckpoint(f"{e.hf[0]}: this rank's shard would be {list(want)} but model parameter "
                                        f"{local} is {list(params[local].shape)}: model built for another config")
    for local, e in plan:  # then stream: one shard in memory at a time
        params[local].data.copy_(_read_shard(e, reader, arch, lay, _hf_names_for(e, arch, reader)))
    return len(plan)


def _shard_shape(entry: Entry, arch: ModelArch, lay: Layout) -> tuple[int, ...]:
    tp, _ = _tp_split(entry, lay)
    first = entry.hf_shapes[0]
    if entry.kind == "rep":
        return first
    if entry.kind == "row0":
        return (first[0] // tp, *first[1:])
    if entry.kind == "row1":
        return (first[0], first[1] // tp)
    rows = sum(s[0] for s in entry.hf_shapes) // tp
    return (rows, *first[1:])


# ----------------------------------------------------------------------------------------------- export


def _group_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_tp(t: torch.Tensor, dim: int, group) -> list[torch.Tensor]:
    size, _ = _group_rank(group)
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _assemble(entry: Entry, parts: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    k = entry.kind
    if k == "rep":
        return [parts[0]]
    if k == "row0":
        return [torch.cat(parts, 0)]
    if k == "row1":
        return [torch.cat(parts, 1)]
    if k == "glu":
        halves = [p.chunk(2, dim=0) for p in parts]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if k == "qkv":
        hd = arch.head_dim
        qpg = arch.num_heads // arch.num_kv_heads
        full = torch.cat(parts, 0)
        tail = full.shape[1:]
        full = full.reshape(arch.num_kv_heads, (qpg + 2) * hd, *tail)
        q, kk, v = full.split([qpg * hd, hd, hd], dim=1)
        return [q.reshape(-1, *tail), kk.reshape(-1, *tail), v.reshape(-1, *tail)]
    raise AssertionError(k)


def _broadcast_from(t: torch.Tensor | None, shape, dtype, device, src_group_rank: int, group) -> torch.Tensor:
    size, me = _group_rank(group)
    if size == 1:
        assert t is not None
        return t
    buf = t.contiguous() if me == src_group_rank else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=dist.get_global_rank(group, src_group_rank), group=group)
    return buf


@torch.no_grad()
def iter_hf_tensors(model, arch: ModelArch, layout: Layout | None = None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full tensor)` for every weight, in `hf_tensor_names` order, on every rank.

    Collective: all ranks must consume the iterator in lockstep. Tensors live on the model's device; they are
    freshly assembled (never views of parameters when any parallelism is used), so consumers may keep them.
    """
    from megatron.core import parallel_state as ps

    lay = layout or Layout.current()
    model = unwrap(model)
    params = Params(model.named_parameters())
    ref = next(iter(params.values()))
    device, pdtype = ref.device, ref.dtype
    tp_group = ps.get_tensor_model_parallel_group() if lay.tp > 1 else None
    etp_group = ps.get_expert_tensor_parallel_group() if lay.etp > 1 else None
    ep_group = ps.get_expert_model_parallel_group() if lay.ep > 1 else None
    pp_group = ps.get_pipeline_model_parallel_group() if lay.pp > 1 else None
    for e in _entries(arch):
        local = _local_name(e, arch, lay)
        stage = _stage_of(e, arch, lay.pp)
        tp, _ = _tp_split(e, lay)
        full: list[torch.Tensor] | None = None
        if local is not None:
            t = params[local].detach()
            parts = _gather_tp(t, 0, etp_group if e.expert is not None else tp_group) if tp > 1 else [t]
            full = _assemble(e, parts, arch)
        if e.expert is not None and lay.ep > 1:
            owner = e.expert // (arch.num_experts // lay.ep)
            if stage == lay.pp_rank:
                full = [_broadcast_from(full[i] if full else None, s, pdtype, device, owner, ep_group)
                        for i, s in enumerate(e.hf_shapes)]
        if lay.pp > 1:
            full = [_broadcast_from(full[i] if full else None, s, pdtype, device, stage, pp_group)
                    for i, s in enumerate(e.hf_shapes)]
        assert full is not None
        for name, t in zip(e.hf, full, strict=True):
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t


# ----------------------------------------------------------------------------------------- bucketed export


@dataclass
class BucketPlan:
    """One bucket of the export: whole HF tensors of `entries`, all on pipeline stage `stage`, assembled with at
    most one collective inside the stage: `via` "tp" (an all-gather of every rank's shards of the TP-split
    entries over the TP group), "ep" (an all-gather of `experts_per_rank` local experts of one layer over the
    expert-tensor-and-model-parallel group, so every EP and expert-TP rank's shards in one call) or "none"
    (replicated or unsplit entries: local copies). Replicated entries ride along in any bucket."""

    stage: int
    via: str
    entries: list[Entry]
    nbytes: int = 0
    layer: int | None = None  # "ep": the layer, and the first local expert index of the chunk
    first_local: int = 0
    experts_per_rank: int = 0


def _entry_bytes(entry: Entry, elem: int) -> int:
    return sum(int(torch.Size(s).numel()) for s in entry.hf_shapes) * elem


def _via(entry: Entry, lay: Layout) -> str:
    if entry.expert is not None:
        return "ep" if lay.ep * lay.etp > 1 else "none"
    return "tp" if _tp_split(entry, lay)[0] > 1 else "none"


def plan_buckets(arch: ModelArch, lay: Layout, bucket_bytes: int, elem: int = 2) -> list[BucketPlan]:
    """The export's buckets for layout `lay`, the same on every rank (the collectives pair up): consecutive
    entries until about `bucket_bytes` (`elem` bytes an element), a new bucket where the stage or the collective
    changes. Experts split over EP / expert TP go by layer in chunks of the same local experts on every rank
    (as many as fit, at least one each), so all the experts of a layer take one collective when a bucket holds
    them."""
    plans: list[BucketPlan] = []
    cur: BucketPlan | None = None
    entries = _entries(arch)
    i = 0
    while i < len(entries):
        e = entries[i]
        stage, via = _stage_of(e, arch, lay.pp), _via(e, lay)
        if via == "ep":  # every expert entry of this layer, chunked by local expert index
            layer_entries = [x for x in entries[i:] if x.layer == e.layer and x.expert is not None]
            per = arch.num_experts // lay.ep
            per_expert = sum(_entry_bytes(x, elem) for x in layer_entries if x.expert == 0)
            chunk = max(1, min(per, bucket_bytes // max(1, per_expert * lay.ep)))
            for j in range(0, per, chunk):
                m = min(chunk, per - j)
                locals_ = {k * per + jj for k in range(lay.ep) for jj in range(j, j + m)}
                part = sorted((x for x in layer_entries if x.expert in locals_), key=lambda x: (x.expert, x.mcore))
                plans.append(BucketPlan(stage, "ep", part, sum(_entry_bytes(x, elem) for x in part), e.layer, j, m))
            cur = None
            i += len(layer_entries)
            continue
        n = _entry_bytes(e, elem)
        fits = cur is not None and cur.stage == stage and cur.nbytes + n <= bucket_bytes and \
            (via == "none" or cur.via in ("none", via))
        if not fits:
            cur = BucketPlan(stage, via, [])
            plans.append(cur)
        elif via != "none":
            cur.via = via
        cur.entries.append(e)
        cur.nbytes += n
        i += 1
    return plans


def _gather(local: torch.Tensor, group) -> torch.Tensor:
    """[group size, n]: every rank's `local` [n], one all-gather."""
    size, _ = _group_rank(group)
    out = torch.empty(size, local.numel(), dtype=local.dtype, device=local.device)
    if local.is_cuda:
        dist.all_gather_into_tensor(out, local, group=group)
    else:  # gloo: the list form, into views of the one buffer
        dist.all_gather(list(out.unbind(0)), local, group=group)
    return out


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    return [p.view(s) for p, s in zip(flat.split(sizes), shapes, strict=True)]


def _assemble_bucket(plan: BucketPlan, params: dict, arch: ModelArch, lay: Layout, groups: dict) -> list:
    """(hf name, full tensor) of every entry of `plan` on a rank of its stage, with at most one collective."""
    parts: dict[str, list[torch.Tensor]] = {}
    if plan.via == "ep":
        per = arch.num_experts // lay.ep
        mine = [x for x in plan.entries if x.expert < per]  # the chunk as expert rank 0 holds it (local = global)
        local = [params[_local_name(x, arch, replace(lay, ep_rank=0))].detach() for x in mine]
        shapes = [tuple(t.shape) for t in local]
        rows = _gather(torch.cat([t.reshape(-1) for t in local]), groups["ep"])  # [ep * etp, n]
        for k in range(lay.ep):  # group rank = ep_rank * etp + etp_rank (expert TP innermost)
            shards = [_split(rows[k * lay.etp + t], shapes) for t in range(lay.etp)]
            for i, x in enumerate(mine):
                parts[x.mcore.replace(f"local_experts.{x.expert}.", f"local_experts.{x.expert + k * per}.", 1)] = \
                    [s[i] for s in shards]
    split = [e for e in plan.entries if _via(e, lay) == "tp"]
    if split:
        local = [params[_local_name(e, arch, lay)].detach() for e in split]
        shapes = [tuple(t.shape) for t in local]
        rows = _gather(torch.cat([t.reshape(-1) for t in local]), groups["tp"])  # [tp, n]
        per_rank = [_split(r, shapes) for r in rows]
        parts = {e.mcore: [p[i] for p in per_rank] for i, e in enumerate(split)}
    out = []
    for e in plan.entries:
        full = _assemble(e, parts[e.mcore] if e.mcore in parts else [params[_local_name(e, arch, lay)].detach()], arch)
        out.extend(zip(e.hf, full, strict=True))
    return out


@torch.no_grad()
def iter_hf_buckets(model, arch: ModelArch, layout: Layout | None = None, bucket_bytes: int = 64 << 20,
                    dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The HF tensors of `iter_hf_tensors` in buckets of about `bucket_bytes` (`plan_buckets`), on every rank,
    with one collective per bucket inside a pipeline stage (and one broadcast of the bucket over the pipeline
    group under PP): the TP shards of a bucket's tensors, or a chunk of a layer's experts over EP, travel in one
    all-gather instead of one call per tensor (per expert). Collective: every rank consumes it in lockstep."""
    from megatron.core import parallel_state as ps

    lay = layout or Layout.current()
    params = Params(unwrap(model).named_parameters())
    ref = next(iter(params.values()))
    elem = ref.element_size()
    groups = {"tp": ps.get_tensor_model_parallel_group() if lay.tp > 1 else None,
              "ep": ps.get_expert_tensor_and_model_parallel_group() if lay.ep * lay.etp > 1 else None}
    pp_group = ps.get_pipeline_model_parallel_group() if lay.pp > 1 else None
    for plan in plan_buckets(arch, lay, bucket_bytes, elem):
        named = _assemble_bucket(plan, params, arch, lay, groups) if plan.stage == lay.pp_rank else None
        if pp_group is not None:
            shapes = [s for e in plan.entries for s in e.hf_shapes]
            flat = torch.cat([t.reshape(-1) for _, t in named]) if named is not None else \
                torch.empty(sum(int(torch.Size(s).numel()) for s in shapes), dtype=ref.dtype, device=ref.device)
            dist.broadcast(flat, src=dist.get_global_rank(pp_group, plan.stage), group=pp_group)
            named = list(zip([n for e in plan.entries for n in e.hf], _split(flat, shapes), strict=True))
        assert named is not None
        yield [(n, t.to(dtype) if dtype is not None and t.dtype != dtype else t) for n, t in named]
