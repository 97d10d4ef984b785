"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated before anything starts.

``rollverify train --config configs/tiny_cpu.yaml --out DIR algo.mode=partial trainer.steps=40 seed=1``

A run is expensive (servers, trainer ranks, minutes to days), so every key is checked up front: an unknown key,
a value of the wrong type or out of range, or an inconsistent combination (parallel sizes that do not divide,
an eval larger than the run) is a `ConfigError` that names the key and says what is allowed. A section is the
dataclass its consumer takes: `algo` is `rollverify.strategies.AlgoConfig` itself (the loop's strategies), and
`trainer` is what `megatron_bridge.trainer.MegatronTrainer` takes, so the file and the code share one
definition and nothing is copied or renamed between them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from rollverify.strategies import AlgoConfig


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


def _f(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, factory=None) -> Any:
    """A dataclass field with numeric bounds checked by `_build`."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


LossKind = Literal["grpo", "ppo", "gspo", "sapo", "vespo"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
DecayStyle = Literal["constant", "linear", "cosine"]
Dtype = Literal["auto", "float32", "bfloat16"]


@dataclass
class ModelConfig:
    """The policy: a local HF checkpoint (`path`), or the project's tiny model when `path` is null."""

    path: str | None = None  # local folder with config.json + safetensors; never downloaded
    dtype: Dtype = "auto"  # auto: float32 on CPU, bfloat16 on GPU (engine and trainer alike)
    # --- tiny model (path: null) ---
    moe: bool = False  # tiny Qwen3-MoE (8 experts, top-2) instead of dense Qwen3
    tiny_seed: int = _f(0, ge=0)
    task: str | None = "auto"  # warm-start task; auto: task.name when it is synthetic; null: no warm start
    tiny_overrides: dict[str, Any] = _f(factory=dict)  # other TinyModelSpec fields, e.g. {hidden_size: 128}
    # `rollverify plan` where model.path/config.json is not on this machine: a preset (rollverify.app.plan.ARCH_PRESETS:
    # qwen3-8b, qwen3-30b-a3b) or the fields of the checkpoint's config.json
    arch: str | dict[str, Any] | None = None

    def tiny_spec(self) -> dict[str, Any]:
        """Keyword arguments of `TinyModelSpec` (after `RunConfig.from_dict` / `load_config` resolved `task`)."""
        if self.task == "auto":
            raise ValueError(
                "model.task is still 'auto': build the config with load_config or RunConfig.from_dict"
            )
        return {"moe": self.moe, "seed": self.tiny_seed, "task": self.task, **self.tiny_overrides}


@dataclass
class TaskConfig:
    """Where prompts come from and how responses are scored (`rollverify.tasks`)."""

    name: str = "countdown"  # a registered task: countdown, countdown_short, math
    options: dict[str, Any] = _f(factory=dict)  # task arguments, e.g. {train_path: data/dapo.parquet}
    # A reward function instead of the task's own: module:function or path/to/file.py:function, called as
    # fn(prompt, response, label) -> float (rollverify.tasks.reward)
    reward: str | None = None


@dataclass
class RolloutConfig:
    """SGLang rollout: servers, GRPO batch shape, sampling, concurrency."""

    n_servers: int = _f(1, ge=1)  # servers launched by `rollverify train` (ignored with endpoints)
    endpoints: list[str] = _f(factory=list)  # connect to running servers instead of launching
    batch_groups: int = _f(8, ge=1)  # B: finished groups per optimizer step
    n: int = _f(4, ge=2)  # responses per prompt (GRPO group size)
    max_new_tokens: int = _f(256, ge=1)
    temperature: float = _f(1.0, gt=0.0)
    # Responses generated at once over all servers. Above B*n it over-provisions: extra groups run while the
    # slow tail finishes, which is where partial rollout gains its speed.
    max_live: int = _f(64, ge=1)
    engine_args: dict[str, Any] = _f(
        factory=dict
    )  # SGLang ServerArgs, e.g. {tp_size: 4, max_total_tokens: 8192}
    # A server that does not answer for this long is lost: its unfinished responses go to the others. Servers
    # `rollverify train` launched are also watched by process, and restarted when they exit.
    server_timeout_s: float = _f(300.0, gt=0.0)


@dataclass
class TrainerConfig:
    """The trainer: optimiser, policy loss, parallel layout, limits. `megatron_bridge.trainer.MegatronTrainer`
    takes this section as it is; the model's dtype, the seed and the sampling temperature it reads from their
    own sections."""

    steps: int = _f(40, ge=1)  # optimizer steps (= policy versions) of the run; the lr schedule decays over them
    lr: float = _f(1e-6, gt=0.0)  # the paper's 1e-6; the tiny CPU model needs ~1e-4
    min_lr: float = _f(0.0, ge=0.0)
    lr_warmup_steps: int = _f(0, ge=0)
    lr_decay_style: DecayStyle = "constant"
    weight_decay: float = _f(0.0, ge=0.0)
    grad_clip: float = _f(1.0, gt=0.0)  # global gradient norm bound
    optimizer: Literal["adam", "sgd"] = "adam"
    adam_beta1: float = _f(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = _f(0.999, ge=0.0, lt=1.0)
    adam_eps: float = _f(1e-8, gt=0.0)
    use_distributed_optimizer: bool = True  # Megatron-Core's optimizer-state sharding over DP (Adam only)
    loss: LossKind = "grpo"  # grpo (= ppo: PPO surrogate on GRPO advantages), gspo, sapo, vespo
    # VeRL's names; null: the loss's own as in VeRL (grpo, vespo: token-mean; gspo, sapo: seq-mean-token-mean)
    loss_agg_mode: AggMode | None = None
    eps_low: float = _f(0.2, ge=0.0, lt=1.0)  # decoupled clipping: ratio in [1 - eps_low, 1 + eps_high]
    eps_high: float = _f(0.3, ge=0.0)
    dual_clip_c: float = _f(3.0, gt=1.0)  # dual-clip bound for negative advantages; inf: off
    use_tis: bool = True
    tis_cap: float = _f(2.0, gt=0.0)  # truncated importance sampling cap C; inf: untruncated
    gspo_eps_low: float = _f(3e-4, ge=0.0)
    gspo_eps_high: float = _f(4e-4, ge=0.0)
    sapo_tau_pos: float = _f(1.0, gt=0.0)
    sapo_tau_neg: float = _f(1.05, gt=0.0)
    vespo_c1_pos: float = _f(2.0, ge=0.0)  # VESPO's kernel W^c1 exp(c2 (1 - W)) for A >= 0
    vespo_c2_pos: float = _f(3.0, gt=0.0)
    vespo_c1_neg: float = _f(3.0, ge=0.0)  # and for A < 0
    vespo_c2_neg: float = _f(2.0, gt=0.0)
    adv_use_std: bool = True  # GRPO: divide advantages by the group std (false: Dr. GRPO)
    tp: int = _f(1, ge=1)  # tensor parallel
    pp: int = _f(1, ge=1)  # pipeline parallel
    ep: int = _f(1, ge=1)  # expert parallel (carved out of tp*dp, as in Megatron-Core)
    dp: int = _f(1, ge=1)  # data parallel; world size = tp * pp * cp * dp
    cp: int = _f(1, ge=1)  # context parallel: every packed sequence split over cp ranks (dense models)
    etp: int = _f(1, ge=1)  # expert tensor parallel: each expert's weights split over etp ranks (1: whole)
    micro_batch_tokens: int = _f(4096, ge=1)  # packed tokens per micro-batch
    replay_verify: bool = False  # MoE: replay the engine's routes when computing log-probs for verification
    replay_train: bool = True  # MoE: routing replay (R3) for the old-log-prob recompute and the training step
    recompute: Literal["none", "selective", "full"] = "none"  # activation recompute in the training backward
    sequence_parallel: bool = False  # split the sequence over the TP group between layers (needs tp > 1)
    logprob_chunk_tokens: int = _f(1024, ge=1)  # tokens whose [tokens x vocab/tp] logits exist at once
    max_seq_len: int = _f(0, ge=0)  # most model inputs (prompt + response - 1) per sequence; 0: the model context
    dist_timeout_s: float = _f(1800.0, gt=0.0)  # trainer collectives (gloo / NCCL) that wait longer fail
    call_timeout_s: float = _f(3600.0, gt=0.0)  # a trainer rank silent for longer during a call fails it
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda where a GPU is visible, else cpu
    # the colocated memory handoff: from each weight push to the next training phase the trainer's parameters,
    # gradients and optimizer state leave the device (megatron_bridge.offload) while the servers hold theirs.
    # null: on where the servers release their memory too (cluster.launcher ray, placement colocated), else off
    offload_between_phases: bool | None = None

    def offloads(self, launcher: str, placement: str) -> bool:
        """Whether the trainer offloads between phases in this cluster layout (`offload_between_phases`)."""
        if self.offload_between_phases is None:
            return launcher == "ray" and placement == "colocated"
        return self.offload_between_phases

    @property
    def loss_kind(self) -> str:
        """The loss function `loss` names in `rollverify.losses` (grpo's surrogate is ppo's)."""
        return "ppo" if self.loss == "grpo" else self.loss

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


@dataclass
class ClusterConfig:
    """Where the trainer ranks and servers run; `rollverify plan` places them, the launchers start them there."""

    launcher: Literal["local", "ray"] = "local"  # local: processes on this machine; ray: Ray actors on a cluster
    nodes: int = _f(1, ge=1)
    gpus_per_node: int = _f(0, ge=0)  # 0: CPU only
    placement: Literal["colocated", "disaggregated"] = "colocated"  # colocated: rollout and training take turns
    rollout_gpus: int = _f(0, ge=0)  # disaggregated: the last GPUs go to the servers, the rest to the trainer
    gpu_memory_gib: float = _f(80.0, gt=0.0)  # per GPU, as `plan` budgets it
    # --- ray launcher (rollverify.app.cluster) ---
    address: str | None = None  # Ray cluster to join (auto, HEAD_IP:6379); null: RAY_ADDRESS, else a one-node Ray here
    join_timeout_s: float = _f(120.0, gt=0.0)  # nodes, placement group and file checks that take longer fail
    log_to_driver: bool = True  # actors' stdout/stderr (trainer ranks, server actors) echoed by the driver

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class EvalConfig:
    """Evaluation with the current policy (`rollverify.app.evaluate`): the task's held-out split, or named sets."""

    every: int = _f(10, ge=0)  # steps between evaluations (and at the last step); 0: never
    n_prompts: int = _f(64, ge=1)  # prompts of the held-out split; sets are evaluated whole
    # Benchmark files in the project's layout (tools/prepare_data.py), by name: {aime24: data/aime24.parquet,
    # math500: {path: data/math500.jsonl, prompt_key: problem, label_key: answer}}; empty: the held-out split
    sets: dict[str, Any] = _f(factory=dict)
    n_samples: int = _f(1, ge=1)  # k responses per prompt: eval/<set>/avg@k and pass@k
    temperature: float = _f(1.0, gt=0.0)
    max_new_tokens: int | None = _f(None, ge=1)  # null: rollout.max_new_tokens
    solved_at: float = 1.0  # a response whose reward is >= this counts as solved for pass@k


@dataclass
class LogConfig:
    """What the run directory gets besides metrics.jsonl and summary.json."""

    tensorboard: bool = True  # event files under DIR/tensorboard
    plots: bool = True  # PNGs under DIR/plots at the end of the run
    wandb: bool = False  # needs the wandb package; offline unless wandb_mode says otherwise
    wandb_project: str = "rollverify"
    wandb_mode: Literal["offline", "online"] = "offline"
    run_name: str | None = None
    checkpoint_every: int = _f(0, ge=0)  # steps between checkpoints (DIR/checkpoint); 0: never
    export_every: int = _f(0, ge=0)  # steps between Hugging Face exports (DIR/hf/step_N); 0: none during the run
    export_final: bool = True  # DIR/hf/step_N of the last step at the end of the run


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "rollout": RolloutConfig,
    "algo": AlgoConfig,
    "trainer": TrainerConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "cluster": ClusterConfig,
}
TOP_LEVEL = ("seed",)


@dataclass
class RunConfig:
    """One run: the sections above plus the seed every random choice derives from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_paths(self) -> None:
        """The local files this run reads exist: `model.path` (a Hugging Face folder) and the data files named
        in `task.options` (`*path` keys) and `eval.sets`. Separate from validation so that a dry run can read configs whose
        files live on another machine; every entry point that starts work calls it first."""
        m = self.model
        if m.path is not None:
            path = Path(m.path).expanduser()
            fix = "point model.path at a local Hugging Face model folder, or set model.path=null for the tiny CPU model"
            if not path.is_dir():
                raise ConfigError(f"model.path: {path} {'is not a folder' if path.exists() else 'does not exist'}; {fix}")
            missing = [n for n in ("config.json",) if not (path / n).is_file()]
            if not any(path.glob("*.safetensors")):
                missing.append("*.safetensors")
            if missing:
                raise ConfigError(f"model.path: {path} has no {' and no '.join(missing)}; {fix}")
        for key, value in self.task.options.items():
            if key.endswith("path") and isinstance(value, str) and not Path(value).expanduser().is_file():
                raise ConfigError(
                    f"task.options.{key}: data file {value} does not exist; give the path of a local JSONL or "
                    "parquet file (tools/prepare_data.py converts the published layouts)"
                )
        for name, spec in self.eval.sets.items():
            path = spec.get("path") if isinstance(spec, dict) else spec
            if isinstance(path, str) and not Path(path).expanduser().is_file():
                raise ConfigError(
                    f"eval.sets.{name}: data file {path} does not exist; give the path of a local JSONL or parquet "
                    "file (tools/prepare_data.py converts the published layouts)"
                )

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, check_task: bool = True) -> RunConfig:
        """Validate and build; `check_task=False` skips building the task (it may read a data file)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
        allowed = list(SECTIONS) + list(TOP_LEVEL)
        for key in raw:
            if key not in allowed:
                raise ConfigError(
                    f"unknown config section {key!r}{_suggest(key, allowed)}; allowed: {', '.join(allowed)}"
                )
        kw: dict[str, Any] = {}
        for name, cls_ in SECTIONS.items():
            section = raw.get(name) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{name}: expected a mapping of settings, got {section!r}")
            kw[name] = _build(cls_, section, name)
        if "seed" in raw:
            kw["seed"] = _coerce(raw["seed"], int, "seed")
            if kw["seed"] < 0:
                raise ConfigError(f"seed: must be >= 0, got {kw['seed']}")
        cfg = cls(**kw)
        cfg._check(check_task)
        return cfg

    def _check(self, check_task: bool) -> None:
        """Rules that span keys or sections."""
        from rollverify.tasks import get_task, synthetic_task_names, task_names

        r, t, m = self.rollout, self.trainer, self.model
        if self.task.name not in task_names():
            raise ConfigError(
                f"task.name: unknown task {self.task.name!r}; registered: {', '.join(task_names())}"
            )
        if check_task:
            try:
                get_task(self.task.name, **self.task.options)
            except (ValueError, FileNotFoundError) as e:
                raise ConfigError(f"task.options: {e}") from None
        self._check_reward_and_eval(check_task)
        if m.task == "auto":
            m.task = self.task.name if (m.path is None and self.task.name in synthetic_task_names()) else None
        elif m.task is not None and m.task not in synthetic_task_names():
            raise ConfigError(
                f"model.task: {m.task!r} is not a synthetic task (no demonstrations to warm-start on); "
                f"allowed: {', '.join(synthetic_task_names())} or null"
            )
        if m.path is not None and (m.moe or m.tiny_overrides):
            raise ConfigError(
                "model.moe / model.tiny_overrides describe the tiny model; drop them with model.path"
            )
        if m.tiny_overrides:
            from rollverify.app.tiny_model import TinyModelSpec

            hints = typing.get_type_hints(TinyModelSpec)
            names = [f.name for f in fields(TinyModelSpec) if f.name not in ("moe", "seed", "task", "extra")]
            for k, v in m.tiny_overrides.items():
                if k not in names:
                    raise ConfigError(
                        f"model.tiny_overrides.{k}: not a tiny-model setting; allowed: {', '.join(names)}"
                    )
                m.tiny_overrides[k] = _coerce(v, hints[k], f"model.tiny_overrides.{k}")
        if not r.endpoints and r.n_servers < 1:
            raise ConfigError(
                "rollout.n_servers: must be >= 1 unless rollout.endpoints lists running servers"
            )
        if r.max_live < r.n:
            raise ConfigError(
                f"rollout.max_live: must be >= rollout.n ({r.n}) so one group fits, got {r.max_live}"
            )
        if (t.tp * t.cp * t.dp) % (t.ep * t.etp):
            span = "tp*dp" if t.cp == 1 else "tp*cp*dp"
            what = "" if t.etp == 1 else f"ep*etp = {t.ep * t.etp} "
            raise ConfigError(f"trainer.ep: {what}must divide {span} = {t.tp * t.cp * t.dp} (Megatron-Core), "
                              f"got {t.ep}")
        if t.ep > 1 and m.path is None and not m.moe:
            raise ConfigError("trainer.ep: expert parallelism needs an MoE model (model.moe: true)")
        if self.algo.verify_on == "engine" and r.temperature != 1.0:
            raise ConfigError(
                f"algo.verify_on: engine needs rollout.temperature 1, got {r.temperature}: SGLang's prefill log-probs "
                "are untempered, so only then do they match the sampled ones; set algo.verify_on=trainer"
            )
        if self.algo.verify_on == "engine" and t.replay_verify:
            raise ConfigError(
                "trainer.replay_verify: with algo.verify_on: engine the engines compute the new log-probs with free "
                "routing; set trainer.replay_verify=false or algo.verify_on=trainer"
            )
        if t.min_lr > t.lr:
            raise ConfigError(f"trainer.min_lr: must be <= trainer.lr ({t.lr}), got {t.min_lr}")
        if t.optimizer != "adam" and t.use_distributed_optimizer:
            raise ConfigError(f"trainer.optimizer: Megatron-Core's distributed optimizer supports adam only, got "
                              f"{t.optimizer!r}; set trainer.use_distributed_optimizer=false")
        if t.sequence_parallel and t.tp == 1:
            raise ConfigError("trainer.sequence_parallel: needs trainer.tp > 1 (it splits the sequence over TP)")
        if t.recompute != "none" and t.replay_train and m.path is None and m.moe:
            raise ConfigError(f"trainer.recompute: {t.recompute!r} with MoE routing replay is not supported (the "
                              "recomputed forward would route freely); set it to none or trainer.replay_train=false")
        self._check_cluster()
        if self.log.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "log.wandb: true needs the wandb package, which is not installed; set log.wandb=false"
            )

    def _check_cluster(self) -> None:
        """Cluster keys that contradict each other (what fits on the cluster is `rollverify plan`'s check)."""
        from rollverify.app.plan import ARCH_PRESETS

        c, m = self.cluster, self.model
        if m.arch is not None:
            if m.path is None:
                raise ConfigError("model.arch: the tiny model's architecture comes from its spec; set model.path too")
            if isinstance(m.arch, str) and m.arch not in ARCH_PRESETS:
                raise ConfigError(
                    f"model.arch: unknown preset {m.arch!r}{_suggest(m.arch, list(ARCH_PRESETS))}; presets: "
                    f"{', '.join(ARCH_PRESETS)}, or a mapping of the model's config.json fields"
                )
        if c.launcher == "local" and c.nodes > 1:
            raise ConfigError(
                f"cluster.nodes: the local launcher runs on this machine only, got {c.nodes} nodes; "
                "set cluster.launcher=ray"
            )
        if self.trainer.offload_between_phases and (c.launcher, c.placement) != ("ray", "colocated"):
            raise ConfigError(
                f"trainer.offload_between_phases: only a colocated Ray run hands GPU memory between trainer and "
                f"servers (here launcher {c.launcher}, placement {c.placement}: the servers keep their memory, so "
                f"nothing would use what the trainer frees); set it to null or false"
            )
        if c.placement == "colocated" and c.rollout_gpus:
            raise ConfigError(
                f"cluster.rollout_gpus: colocated servers share every GPU with the trainer, got {c.rollout_gpus}; "
                "set it to 0 or cluster.placement=disaggregated"
            )
        if c.placement == "disaggregated" and not 0 < c.rollout_gpus < c.gpus:
            raise ConfigError(
                f"cluster.rollout_gpus: disaggregated needs GPUs for both sides, 0 < rollout_gpus < "
                f"nodes*gpus_per_node = {c.gpus}, got {c.rollout_gpus}"
            )

    def _check_reward_and_eval(self, check_task: bool) -> None:
        """task.reward imports, the chat template the tokenizer must have, eval.sets' entries; with
        `check_task`, also the reward function and the sets' files (both are read, like the task's data)."""
        from rollverify.app.evaluate import load_eval_sets, parse_eval_sets
        from rollverify.tasks.chat import has_chat_template
        from rollverify.tasks.reward import load_reward

        if self.task.reward is not None and check_task:
            try:
                load_reward(self.task.reward)
            except ValueError as e:
                raise ConfigError(f"task.reward: {e}") from None
        m = self.model
        if self.task.options.get("chat_template") is True and not (
            m.path is not None and (not Path(m.path).is_dir() or has_chat_template(m.path))
        ):
            raise ConfigError(
                f"task.options.chat_template: true, but the tokenizer of "
                f"{m.path or 'the tiny model'} has no chat template; set it to auto or false"
            )
        try:
            specs = parse_eval_sets(self.eval.sets)
            if check_task:
                load_eval_sets(specs)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"eval.sets: {e}") from None


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(tp) else "")
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number (inf allowed)", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp`, or a ConfigError naming `key` and what it accepts."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_describe(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise bad
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                pass
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 and inf as strings
            try:
                return float(value.strip())
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        (elem,) = typing.get_args(tp)[:1] or (Any,)
        return [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad
        return dict(value)
    raise TypeError(f"config type {tp!r} of {key} is not supported")


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """An instance of the dataclass `cls` from `raw`, checking names, types and bounds."""
    hints = typing.get_type_hints(cls)
    flds = {f.name: f for f in fields(cls) if f.init}
    kw = {}
    for key, value in raw.items():
        if key not in flds:
            names = list(flds)
            raise ConfigError(
                f"unknown config key {prefix}.{key}{_suggest(key, names)}; allowed in {prefix}: {', '.join(names)}"
            )
        name = f"{prefix}.{key}"
        v = _coerce(value, hints[key], name)
        meta = flds[key].metadata
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isnan(v):
                raise ConfigError(f"{name}: must be a number, got nan")
            for op, bound, ok in (
                (">=", meta.get("ge"), lambda a, b: a >= b),
                (">", meta.get("gt"), lambda a, b: a > b),
                ("<=", meta.get("le"), lambda a, b: a <= b),
                ("<", meta.get("lt"), lambda a, b: a < b),
            ):
                if bound is not None and not ok(v, bound):
                    raise ConfigError(f"{name}: must be {op} {bound}, got {v}")
        kw[key] = v
    try:
        return cls(**kw)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # AlgoConfig's own checks name the key already
        raise ConfigError(str(e)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML: numbers, true/false, null, lists, strings)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. trainer.steps=40")
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r}: empty part in key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Set each dotted override into the raw (unvalidated) config, creating sections as needed."""
    for text in overrides:
        path, value = parse_override(text)
        cur = raw
        for i, part in enumerate(path[:-1]):
            nxt = cur.get(part)
            if nxt is None:
                nxt = cur[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is not a section")
            cur = nxt
        cur[path[-1]] = value
    return raw


# The configs shipped with the package: rollverify/configs (in a checkout, a link to configs/ at its root).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def find_config(name: str | Path) -> Path:
    """A YAML file that exists, or the name of a shipped config (`tiny_cpu` or `tiny_cpu.yaml`), found from any
    folder."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.parent == Path("."):
        shipped = CONFIG_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(
        f"config file {name} does not exist; give a YAML path or the name of a shipped config: "
        f"{', '.join(shipped_configs())}"
    )


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, check_task: bool = True
) -> RunConfig:
    """Read a YAML config (a path or a shipped config's name; None: all defaults), apply overrides, validate."""
    raw: Any = {}
    if path is not None:
        path = find_config(path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    try:
        return RunConfig.from_dict(apply_overrides(raw, list(overrides)), check_task=check_task)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None
