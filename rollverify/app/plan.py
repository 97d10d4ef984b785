"""`rollverify plan`: where every trainer rank and server goes, and what each GPU holds, before anything starts.

``rollverify plan --config configs/qwen3_8b_base.yaml [key=value ...]`` needs no GPU, no weights and no data: the
architecture comes from `model.path`/config.json when that file exists here, else from `model.arch` (a preset
name below, or the fields of a Hugging Face config.json). `rollverify train` runs the same `check` first.

Placement (`cluster`): GPUs are numbered node by node (global GPU g is GPU g % gpus_per_node of node
g // gpus_per_node). Trainer rank r takes global GPU r (Megatron-Core's rank order puts TP innermost, so a TP
group stays inside a node). Server i takes `gpus_per_server` consecutive GPUs (SGLang's `base_gpu_id` is the
first), from GPU 0 when colocated and after the trainer's GPUs when disaggregated; a server never spans nodes.
On a CPU cluster (`gpus_per_node: 0`) ranks and servers are spread over the nodes in contiguous blocks.

Memory per GPU, in bytes (formulas documented in docs/cluster.md, "What plan counts"):

* trainer, per rank of the fullest pipeline stage: bf16 weights (2 B/param), fp32 gradients (4 B/param: the
  trainer reduces gradients in fp32), fp32 main params + Adam moments (12 B/param) sharded by the distributed
  optimizer over data parallel (dense: dp*cp ranks; experts: world / (pp*ep*etp)); activations of one
  micro-batch of max(micro_batch_tokens, context) tokens (`layer_activation_bytes` per token per layer, counted
  from what Megatron-Core's layer saves; all layers held: 1F1B keeps pp micro-batches of L/pp layers on the
  first stage; selective recompute drops
  `selective_freed_bytes`; full recompute keeps each layer's input plus one layer's working set); the final
  hidden states and one log-prob chunk of logits.
* server: weights / tp_size; KV cache for min(ceil(max_live / servers) + n - 1, max_running_requests)
  responses at full context, 2 * layers * max(1, kv_heads / tp) * head_dim * kv_bytes per token per GPU; the KV pool SGLang
  can have is mem_fraction_static * GPU memory - weights (or `max_total_tokens` when set).
* per phase and GPU: the run's own start-up and phase order (rollverify.app.handoff) replayed on a ledger of
  the plan's GPUs (rollverify.app.gpu_memory.MemoryBook, with these figures); a GPU that a phase overfills is a
  problem naming the phase, the GPU and every holder's bytes, and the table prints each phase's peak.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollverify.app.config import ConfigError, RunConfig, load_config
from rollverify.app.gpu_memory import PROCESS_OVERHEAD  # noqa: F401 - per GPU process (tools/gpu_smoke.py reads it)
from rollverify.app.presets import ARCH_PRESETS

if TYPE_CHECKING:
    from megatron_bridge.model import ModelArch
    from rollverify.app.gpu_memory import MemoryBook

GiB = 1 << 30

# SGLang picks mem_fraction_static itself when the config does not; plan assumes this value then.
DEFAULT_MEM_FRACTION = 0.85


class PlanError(ConfigError):
    """A config that cannot run on its cluster; the message names the numbers and what to change."""


def model_arch(cfg: RunConfig) -> ModelArch:
    """The architecture without weights: config.json at model.path if present here, else model.arch."""
    from megatron_bridge.model import ModelArch, UnsupportedCheckpoint

    m = cfg.model
    if m.path is None:
        from rollverify.app.tiny_model import TinyModelSpec, hf_config

        spec = TinyModelSpec(**m.tiny_spec())
        arch_name = "Qwen3MoeForCausalLM" if spec.moe else "Qwen3ForCausalLM"
        return ModelArch.from_hf_config({**hf_config(spec).to_dict(), "architectures": [arch_name]})
    stated = None
    if m.arch is not None:
        try:
            stated = ModelArch.from_hf_config(ARCH_PRESETS[m.arch] if isinstance(m.arch, str) else m.arch)
        except (UnsupportedCheckpoint, KeyError, TypeError) as e:
            raise PlanError(f"model.arch: not a usable architecture ({type(e).__name__}: {e})") from None
    folder = Path(m.path).expanduser()
    if (folder / "config.json").is_file():
        try:
            found = ModelArch.from_hf_dir(folder)
        except (UnsupportedCheckpoint, KeyError, ValueError) as e:
            raise PlanError(f"model.path: {folder}/config.json: {e}") from None
        if stated is not None and _dims(stated) != _dims(found):
            raise PlanError(
                f"model.arch {_dims(stated)} differs from {folder}/config.json {_dims(found)}: drop model.arch "
                "or fix it"
            )
        return found
    if stated is None:
        raise PlanError(
            f"model.path {m.path} has no config.json on this machine: set model.arch to "
            f"{' or '.join(ARCH_PRESETS)} or to the fields of the model's config.json"
        )
    return stated


def _dims(a: ModelArch) -> tuple:
    return (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size,
            a.vocab_size, a.num_experts, a.top_k, a.moe_intermediate_size, a.tie_word_embeddings)


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's parallel sizes and memory options, as `trainer` configures them."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    micro_batch_tokens: int = 4096
    logprob_chunk_tokens: int = 1024
    replay_train: bool = True  # MoE routing replay in the training forward

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @staticmethod
    def of(cfg: RunConfig) -> TrainerLayout:
        t = cfg.trainer
        return TrainerLayout(tp=t.tp, pp=t.pp, dp=t.dp, ep=t.ep, etp=t.etp, cp=t.cp,
                             sequence_parallel=t.sequence_parallel,
                             recompute=t.recompute,
                             micro_batch_tokens=t.micro_batch_tokens, logprob_chunk_tokens=t.logprob_chunk_tokens,
                             replay_train=t.replay_train)


def layout_problems(a: ModelArch, lay: TrainerLayout) -> list[str]:
    """What the trainer refuses for this model: `megatron_bridge.model.check_layout` (what divides what) and the
    rules of `megatron_bridge.trainer.MegatronTrainer` that depend on the architecture."""
    from megatron_bridge.model import UnsupportedCheckpoint, check_layout

    out = []
    try:
        check_layout(a, tp=lay.tp, ep=lay.ep, pp=lay.pp, cp=lay.cp, etp=lay.etp)
    except UnsupportedCheckpoint as e:
        out.append(f"trainer.tp/ep/pp/cp/etp: {e}")
    # MegatronTrainer: MoE under TP needs SP, and ep > 1 or etp > 1 so that the experts' gradients are reduced
    if a.moe and lay.tp > 1 and (not lay.sequence_parallel or lay.ep * lay.etp == 1):
        out.append(f"trainer.tp = {lay.tp}: the trainer runs MoE under TP only with trainer.sequence_parallel=true "
                   f"and trainer.ep > 1 or trainer.etp > 1 (got sequence_parallel={lay.sequence_parallel}, "
                   f"ep={lay.ep}, etp={lay.etp})")
    if (lay.tp * lay.dp * lay.cp) % (lay.ep * lay.etp):
        out.append(f"trainer.ep*etp = {lay.ep * lay.etp} does not divide tp*dp*cp = {lay.tp * lay.dp * lay.cp}")
    return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameters on one rank of one pipeline stage: dense (optimizer sharded over dp*cp) and expert."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def total_params(a: ModelArch) -> int:
    """Parameters of the whole model (what a server loads)."""
    one = stage_params(a, TrainerLayout(tp=1, pp=1, dp=1), stage=0)
    return one.total


def stage_params(a: ModelArch, lay: TrainerLayout, stage: int) -> ParamCounts:
    h, q, k = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    attn = (2 * h * q + 2 * h * k + (q + 2 * k if a.attention_bias else 0)) // lay.tp
    norms = 2 * h + 2 * a.head_dim  # input/post-attention RMSNorm, q/k norms (replicated)
    if a.moe:
        dense_layer = attn + norms + h * a.num_experts  # the router is replicated
        expert_layer = 3 * h * a.moe_intermediate_size * a.num_experts // (lay.ep * lay.etp)
    else:
        dense_layer, expert_layer = attn + norms + 3 * h * a.intermediate_size // lay.tp, 0
    layers = a.num_layers // lay.pp
    dense = layers * dense_layer
    embed = a.vocab_size * h // lay.tp
    if stage == 0:
        dense += embed
    if stage == lay.pp - 1:
        dense += h + (0 if (a.tie_word_embeddings and lay.pp == 1) else embed)
    return ParamCounts(dense, layers * expert_layer)


def layer_activation_bytes(a: ModelArch, lay: TrainerLayout) -> int:
    """Bytes one transformer layer keeps for the backward, per token of the micro-batch (bf16, no recompute).

    Counted tensor by tensor from what Megatron-Core 0.16.1's local-spec layer saves (and held to a count of the
    real layer's saved tensors at the Qwen3-8B and Qwen3-30B-A3B shapes, tests/test_activation_bytes.py), with
    CUDA's fused RMSNorm (input + fp32 reciprocal RMS):

    * replicated over TP unless sequence parallel: the two RMSNorm inputs and their fp32 rstd, the QKV input and
      the MLP's (dense: fc1 input; MoE: the router's input): 8h + 8;
    * attention, split by TP: the fused QKV output 2(q + 2k), the q-norm input 2q, rotated Q and K 2q + 2k, the
      attention output and the output projection's input 2q + 2q, the fp32 log-sum-exp 4 heads and the q/k-norm
      rstd 4 (heads + kv_heads): 10q + 6k + 8 heads + 4 kv_heads; RoPE's cos/sin 8 head_dim (not split);
    * dense SwiGLU (`megatron/core/transformer/mlp.py`), split by TP: fc1 output 4I, `x_linear + 0.0` and
      silu's input 2I + 2I, the fc2 input 2I: 10I;
    * MoE, per token routed (split over TP with sequence parallelism): each of the top-k copies keeps its
      permuted input 2h (gathered over etp), its probability 4 and 12 I'/etp (the dense 10 I' plus the product
      before the probability multiply); the router keeps top-k indices and probabilities, the permutation
      index (20 k) and the routing map and probabilities over the experts (5 E).
    """
    h, q, k = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    sp = lay.tp if lay.sequence_parallel else 1
    rep = (8 * h + 8) // sp
    attn = (10 * q + 6 * k + 8 * a.num_heads + 4 * a.num_kv_heads) // lay.tp + 8 * a.head_dim
    if a.moe:
        per_copy = 2 * h * lay.etp + 4 + 12 * a.moe_intermediate_size // lay.etp
        mlp = (a.top_k * per_copy + 20 * a.top_k + 5 * a.num_experts) // sp
    else:
        mlp = 10 * a.intermediate_size // lay.tp
    return rep + attn + mlp


def selective_freed_bytes(a: ModelArch, lay: TrainerLayout) -> int:
    """Per token and layer, what selective recompute drops: core attention's output and its fp32 log-sum-exp
    (its inputs Q, K, V stay: they are the checkpoint's inputs) and, in a dense model, the MLP's inside (10I;
    the MLP's input stays)."""
    q = a.num_heads * a.head_dim
    return (2 * q + 4 * a.num_heads) // lay.tp + (0 if a.moe else 10 * a.intermediate_size // lay.tp)


@dataclass(frozen=True)
class TrainerEstimate:
    """The plan's per-GPU estimate of a trainer rank's memory, in bytes (the offload manager of a running rank is
    megatron_bridge.offload.TrainerMemory)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    tokens: int  # tokens of the largest micro-batch (per CP rank)
    forward: int = 0  # a no-grad forward's working memory (log-probs): one layer's tensors and the logits chunk
    params: ParamCounts | None = None  # the rank's parameters (dense, expert): the host ledger's checkpoint rows

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits


def trainer_memory(a: ModelArch, lay: TrainerLayout, context: int) -> TrainerEstimate:
    """Per-GPU bytes of the fullest pipeline stage (see the module docstring)."""
    stages = [stage_params(a, lay, s) for s in range(lay.pp)]
    p = max(stages, key=lambda c: c.total)
    expert_dp = lay.world_size // (lay.pp * lay.ep * lay.etp)
    tokens = math.ceil(max(lay.micro_batch_tokens, context) / lay.cp)
    per_layer = layer_activation_bytes(a, lay)
    layer_input = 2 * a.hidden_size // (lay.tp if lay.sequence_parallel else 1)
    if lay.recompute == "full":
        acts = tokens * (a.num_layers * layer_input + per_layer)
    elif lay.recompute == "selective":
        acts = tokens * a.num_layers * (per_layer - selective_freed_bytes(a, lay))
    else:
        acts = tokens * a.num_layers * per_layer
    # final hidden states (bf16, TP-replicated) + one chunk of logits: bf16 product, fp32 copy, exp, gradient
    logits = tokens * 2 * a.hidden_size + min(tokens, lay.logprob_chunk_tokens) * (a.vocab_size // lay.tp) * 14
    return TrainerEstimate(
        weights=2 * p.total,
        gradients=4 * p.total,
        optimizer=12 * p.dense // (lay.dp * lay.cp) + 12 * p.expert // expert_dp,
        activations=acts,
        logits=logits,
        tokens=tokens,
        forward=tokens * per_layer + logits,
        params=p,
    )


@dataclass(frozen=True)
class ServerMemory:
    weights: int
    kv_bytes_per_token: int
    kv_needed_tokens: int  # live responses per server x context
    kv_pool_tokens: int  # what the server's KV pool holds
    live_per_server: int

    @property
    def kv_needed(self) -> int:
        return self.kv_needed_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Server:
    index: int
    node: int
    gpus: list[int]  # local GPU ids on its node ([] on CPU); base_gpu_id = gpus[0]


@dataclass
class Plan:
    """Where everything goes and what each GPU holds; `problems` lists what does not fit (empty: it runs).

    `ranks` and `servers` are the placement a launcher follows: trainer rank r on `ranks[r]`, server i on node
    `servers[i].node` with `base_gpu_id = servers[i].gpus[0]`.
    """

    cfg: RunConfig
    arch: ModelArch
    layout: TrainerLayout
    context: int
    gpus_per_server: int
    ranks: list[tuple[int, int | None]]  # rank -> (node, local GPU or None on CPU)
    servers: list[Server]
    trainer: TrainerEstimate
    server: ServerMemory
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # observations that do not stop the run
    book: MemoryBook | None = None  # the replay of the run's phases on a ledger of the GPUs (GPU plans)

    def check(self) -> Plan:
        if self.problems:
            raise PlanError("the config does not fit its cluster:\n  " + "\n  ".join(self.problems))
        return self

    def table(self) -> str:
        return render(self)


def make_plan(cfg: RunConfig) -> Plan:
    """The placement and memory of `cfg`; a layout the trainer refuses raises PlanError at once."""
    a = model_arch(cfg)
    lay = TrainerLayout.of(cfg)
    bad = layout_problems(a, lay)
    if bad:
        raise PlanError("the trainer refuses this layout:\n  " + "\n  ".join(bad))
    r, c, srv = cfg.rollout, cfg.cluster, cfg.servers
    ea = srv.engine_args
    context = ea.context_length or a.max_position_embeddings
    server_tp = ea.gpus
    n_servers = srv.launched
    problems: list[str] = []
    if ea.dp_size > 1 and not ea.enable_dp_attention:
        problems.append(f"servers.engine_args.dp_size = {ea.dp_size}: a server's weight updates need dp_size 1; "
                        "raise servers.count instead")
    if r.max_new_tokens >= context:
        problems.append(f"rollout.max_new_tokens = {r.max_new_tokens} leaves no room for a prompt in the "
                        f"{context}-token context: lower it or raise servers.engine_args.context_length")
    ranks, servers = _place(cfg, lay.world_size, n_servers, server_tp, problems)
    gpu = c.gpus_per_node > 0
    dtype_bytes = {"bfloat16": 2, "float32": 4}.get(cfg.model.dtype, 2 if gpu else 4)  # auto: bf16 on GPU
    weights = dtype_bytes * total_params(a) // server_tp
    kv_heads = max(1, a.num_kv_heads // server_tp)
    kv_bytes = 1 if "fp8" in ea.kv_cache_dtype else dtype_bytes
    per_token = 2 * a.num_layers * kv_heads * a.head_dim * kv_bytes
    # least-loaded assignment of whole groups leaves no server more than one group above its share
    live = math.ceil(r.max_live / srv.total) + r.n - 1
    if ea.max_running_requests:
        live = min(live, ea.max_running_requests)
    frac = ea.mem_fraction_static or DEFAULT_MEM_FRACTION
    if ea.max_total_tokens:
        pool = ea.max_total_tokens
    elif gpu:
        pool = max(0, int(frac * server_free(c.gpu_memory_gib)) - weights) // per_token
    else:
        pool = live * context  # SGLang sizes a CPU pool from free RAM: nothing to check against
    server = ServerMemory(weights, per_token, live * context, pool, live)
    trainer = trainer_memory(a, lay, context)
    plan = Plan(cfg, a, lay, context, server_tp, ranks, servers, trainer, server, problems)
    _check_memory(plan)
    return plan


def server_free(gpu_memory_gib: float) -> int:
    """What SGLang measures free on its GPU before loading (`pre_model_load_memory`), which its KV pool takes
    `mem_fraction_static` of, less the weights: the GPU less its own context (servers start first on their GPUs)."""
    return int(gpu_memory_gib * GiB) - PROCESS_OVERHEAD


def check(cfg: RunConfig) -> Plan:
    """`make_plan(cfg)` that raises PlanError when anything does not fit."""
    return make_plan(cfg).check()


def _place(cfg: RunConfig, world: int, n_servers: int, server_gpus: int, problems: list[str]):
    c = cfg.cluster
    if c.gpus_per_node == 0:
        ranks = [(r * c.nodes // world, None) for r in range(world)]
        servers = [Server(i, i * c.nodes // max(1, n_servers), []) for i in range(n_servers)]
        return ranks, servers
    g, total = c.gpus_per_node, c.nodes * c.gpus_per_node
    disagg = c.placement == "disaggregated"
    train_gpus = total - c.rollout_gpus if disagg else total
    roll_first, roll_gpus = (train_gpus, c.rollout_gpus) if disagg else (0, total)
    where = "the trainer's GPUs (cluster.nodes*gpus_per_node - cluster.rollout_gpus)" if disagg else "the GPUs"
    if world > train_gpus:
        problems.append(
            f"trainer world size {world} (tp*pp*cp*dp) is larger than {where} = {train_gpus}: lower trainer.dp "
            f"to {max(1, train_gpus // (world // cfg.trainer.dp))} or add nodes"
        )
    tp_group = cfg.trainer.tp
    if tp_group > g or g % tp_group:
        problems.append(f"trainer.tp = {tp_group} does not fit whole inside a node of {g} GPUs: use a divisor of {g}")
    if server_gpus > g or g % server_gpus:
        problems.append(
            f"a server takes {server_gpus} GPUs (servers.engine_args tp_size*pp_size), which does not divide a node "
            f"of {g}"
            " GPUs: a server never spans nodes"
        )
    if n_servers * server_gpus > roll_gpus:
        problems.append(
            f"{n_servers} servers x {server_gpus} GPUs = {n_servers * server_gpus} GPUs, more than the "
            f"{roll_gpus} {'cluster.rollout_gpus' if disagg else 'GPUs'}: lower servers.count to "
            f"{roll_gpus // server_gpus}"
        )
    ranks = [(r // g, r % g) for r in range(min(world, train_gpus))]
    servers = []
    for i in range(n_servers):
        first = roll_first + i * server_gpus
        if first + server_gpus > total:
            break
        servers.append(Server(i, first // g, [(first + j) % g for j in range(server_gpus)]))
    return ranks, servers


def _check_memory(p: Plan) -> None:
    c, s, out = p.cfg.cluster, p.server, p.problems
    ea = p.cfg.servers.engine_args
    if p.cfg.servers.endpoints:
        p.notes.append("servers.endpoints: servers someone else runs; their GPUs and memory are not checked here")
    elif s.kv_pool_tokens < s.kv_needed_tokens:
        fits = s.kv_pool_tokens // p.context
        # a CPU server's pool is bounded for RAM's sake; SGLang retracts requests when it runs full
        target = out if c.gpus_per_node else p.notes
        pool = "servers.engine_args.max_total_tokens" if ea.max_total_tokens else (
            f"{ea.mem_fraction_static or DEFAULT_MEM_FRACTION} x {c.gpu_memory_gib} GiB - "
            f"{s.weights / GiB:.1f} GiB weights at {s.kv_bytes_per_token / 1024:.0f} KiB/token per GPU")
        target.append(
            f"KV cache: a server must hold {s.live_per_server} live responses x {p.context} tokens = "
            f"{s.kv_needed_tokens} tokens, its pool holds {s.kv_pool_tokens} ({pool}): set "
            f"servers.engine_args.max_running_requests to {fits} (and rollout.max_live to "
            f"{fits * max(1, len(p.servers))}), or give the pool more (servers.engine_args.mem_fraction_static, "
            "max_total_tokens, tp_size)"
        )
    if c.gpus_per_node == 0:
        return
    frac = ea.mem_fraction_static or DEFAULT_MEM_FRACTION
    if s.weights > frac * server_free(c.gpu_memory_gib) and not p.cfg.servers.endpoints:
        out.append(f"server weights {s.weights / GiB:.1f} GiB per GPU exceed mem_fraction_static x free GPU memory "
                   f"= {frac * server_free(c.gpu_memory_gib) / GiB:.1f} GiB: raise servers.engine_args.tp_size")
    from rollverify.app.handoff import replay

    p.book = replay(p)
    seen: set[str] = set()
    for msg in p.book.ledger.overflows:  # the first GPU that does not fit, per phase
        phase = msg.split(":", 1)[0]
        if phase not in seen:
            seen.add(phase)
            out.append(f"{msg}; {_fix(p, phase.removeprefix('phase '))}")
    seen.clear()
    for msg in p.book.host.ledger.overflows:  # the first node whose RAM does not fit, per phase
        phase = msg.split(":", 1)[0]
        if phase not in seen:
            seen.add(phase)
            out.append(f"{msg} (cluster.host_memory_gib {c.host_memory_gib:g}, of which Ray's memory monitor lets "
                       f"95 % be used); {_host_fix(phase.removeprefix('phase '))}")


def _host_fix(phase: str) -> str:
    """What to change when a node's RAM does not fit `phase`."""
    if phase in ("checkpoint", "restore"):
        return ("a checkpoint gathers each model-parallel shard's fp32 optimizer state (12 bytes a parameter) on the "
                "host: raise trainer.tp/pp/ep, or set cluster.host_memory_gib to the nodes' RAM if it is larger")
    return "set cluster.host_memory_gib to the nodes' RAM if it is larger, or spread the layout over more nodes"


def _fix(p: Plan, phase: str) -> str:
    """What to change when a GPU does not fit `phase`."""
    c, t, lay = p.cfg.cluster, p.trainer, p.layout
    if c.placement == "colocated" and not p.cfg.trainer.offloads(c.launcher, c.placement):
        return ("the trainer keeps its memory while the servers hold theirs: set trainer.offload_between_phases="
                "null" if c.launcher == "ray" else
                "the local launcher's servers and trainer keep their memory: use cluster.launcher=ray (its servers "
                "and trainer hand memory over), or lower servers.engine_args.mem_fraction_static")
    if phase in ("start", "rollout"):
        return "lower servers.engine_args.mem_fraction_static"
    if t.activations > t.weights + t.gradients + t.optimizer:
        split = "raise trainer.tp (with sequence_parallel)"
        shorter = "lower trainer.micro_batch_tokens to the context, " if lay.micro_batch_tokens > p.context else ""
        recompute = "" if lay.recompute == "full" else "set trainer.recompute=full, "
        return (f"activations dominate ({t.tokens} tokens a micro-batch: max(micro_batch_tokens, context)); "
                f"{recompute}{split}, {shorter}or shorten the context")
    return "weights, gradients and optimizer dominate: raise trainer.tp/pp (or ep for experts) or dp"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def render(p: Plan) -> str:
    """The plan as text: model, layout, placement by node and GPU, memory per GPU, problems."""
    a, lay, c, r = p.arch, p.layout, p.cfg.cluster, p.cfg.rollout
    gpu = c.gpus_per_node > 0
    unit, scale = ("GiB", GiB) if gpu else ("MiB", 1 << 20)
    num = lambda b: f"{b / scale:9.2f}"  # noqa: E731
    moe = f", {a.num_experts} experts top-{a.top_k} x {a.moe_intermediate_size}" if a.moe else ""
    where = (f"{c.gpus_per_node} GPUs of {c.gpu_memory_gib} GiB, {c.placement}"
             + (f" ({c.rollout_gpus} GPUs for rollout)" if c.placement == "disaggregated" else "")) if gpu else "CPU"
    eps = p.cfg.servers.endpoints
    n_srv = f"{len(eps)} external endpoint(s)" if eps else f"{len(p.servers)} server(s)"
    lines = [
        f"model    {a.architecture}: {_count(total_params(a))} params, hidden {a.hidden_size}, {a.num_layers} "
        f"layers, {a.num_heads}/{a.num_kv_heads} heads x {a.head_dim}, vocab {a.vocab_size}{moe}",
        f"cluster  {c.launcher} launcher, {c.nodes} node(s) x {where}",
        f"trainer  world {lay.world_size} = tp {lay.tp} x pp {lay.pp} x cp {lay.cp} x dp {lay.dp} (ep {lay.ep}, "
        f"etp {lay.etp}); sequence parallel {'on' if lay.sequence_parallel else 'off'}, recompute {lay.recompute}",
        f"rollout  {n_srv} x {p.gpus_per_server} {'GPU(s)' if gpu else 'device'}, context {p.context}, max_live "
        f"{r.max_live} -> at most {p.server.live_per_server} live per server",
        "",
        "placement",
    ]
    by_slot: dict[tuple[int, int], list[str]] = {}
    for rank, (node, g) in enumerate(p.ranks):
        by_slot.setdefault((node, -1 if g is None else g), []).append(f"trainer rank {rank}")
    for s in p.servers:
        for j, g in enumerate(s.gpus or [-1]):
            by_slot.setdefault((s.node, g), []).append(f"server {s.index}" + (" (base_gpu_id)" if gpu and j == 0
                                                                                else ""))
    for (node, g), who in sorted(by_slot.items()):
        lines.append(f"  node {node}  {'cpu' if g < 0 else f'gpu {g}':>6}  " + ", ".join(who))
    t, s = p.trainer, p.server
    wdt = {"bfloat16": "bf16", "float32": "fp32"}.get(p.cfg.model.dtype, "bf16" if gpu else "fp32")
    rows = [
        ("weights (trainer bf16, server " + wdt + ")", t.weights, s.weights),
        ("gradients (fp32)", t.gradients, None),
        (f"optimizer (fp32 main + Adam, over dp {lay.dp * lay.cp})", t.optimizer, None),
        (f"activations ({t.tokens} tokens, recompute {lay.recompute})", t.activations, None),
        ("final hidden states + one logits chunk", t.logits, None),
        (f"KV cache ({s.live_per_server} x {p.context} tok, {s.kv_bytes_per_token / 1024:.1f} KiB/tok)", None,
         s.kv_needed),
        ("total counted", t.total, s.weights + s.kv_needed),
    ]
    lines += ["", f"memory per {'GPU' if gpu else 'process'} ({unit})".ljust(52) + "  trainer    rollout"]
    for name, tv, sv in rows:
        lines.append(f"  {name:<50}" + (num(tv) if tv is not None else " " * 9) + ("  " + num(sv) if sv is not None
                                                                                 else ""))
    if gpu:
        frac = p.cfg.servers.engine_args.mem_fraction_static or DEFAULT_MEM_FRACTION
        from rollverify.app.gpu_memory import sglang_runtime

        free = server_free(c.gpu_memory_gib)
        runtime = sglang_runtime(p.cfg.servers.engine_args.args(), int(c.gpu_memory_gib * GiB))
        lines.append(f"  GPU {c.gpu_memory_gib} GiB; a server takes mem_fraction_static {frac} x {free / GiB:.1f} GiB "
                     f"free at its start = {frac * free / GiB:.1f} GiB (KV pool {s.kv_pool_tokens} tokens) and SGLang's "
                     f"runtime share {runtime / GiB:.1f} GiB (CUDA graphs, activations); plus "
                     f"{PROCESS_OVERHEAD / GiB:.1f} GiB per process not counted above")
        if c.placement == "colocated" and p.cfg.trainer.offloads(c.launcher, c.placement):
            lines.append("  colocated: one phase at a time, each side releasing its GPU memory for the other's phase")
        elif c.placement == "colocated":
            lines.append("  colocated without the trainer's offload: its state stays on the GPU through rollout")
        if p.book is not None and p.book.enabled:
            from rollverify.app.gpu_memory import PHASES

            lines += ["", *p.book.render()]
            lines += ["", *p.book.host.render(PHASES)]
    else:
        lines.append("  trainer rows: the bf16 GPU formulas, for scale; nothing is checked against RAM")
    lines.append("")
    lines += [f"note: {x}" for x in p.notes]
    lines += [f"DOES NOT FIT: {x}" for x in p.problems] or ["fits"]
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollverify plan",
        description="Print where each trainer rank and server of a config goes (node, GPU) and the memory per GPU; "
        "exit 2 with what to change when it does not fit. Needs no GPU, no weights and no data files; "
        "`rollverify train` runs the same check before it starts.",
        epilog="examples:\n  rollverify plan --config qwen3_8b_base\n"
        "  rollverify plan --config qwen3_8b_base cluster.nodes=2 trainer.dp=2 servers.count=8\n"
        "  rollverify plan --config my.yaml model.arch=qwen3-30b-a3b   (the checkpoint is not on this machine)\n"
        "formulas and the paper configs' tables: docs/cluster.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML config (a path or a shipped config's name)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. cluster.nodes=2 trainer.dp=8")
    a = p.parse_args(argv)
    try:
        plan = make_plan(load_config(a.config, a.overrides, check_task=False))  # data files may be elsewhere
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.table())
    return 2 if plan.problems else 0
