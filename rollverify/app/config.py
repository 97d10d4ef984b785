"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated before anything starts.

``rollverify train --config configs/tiny_cpu.yaml --out DIR algo.mode=partial trainer.steps=40 seed=1``

A run is expensive (servers, trainer ranks, minutes to days), so every key is checked up front: an unknown key,
a value of the wrong type or out of range, or an inconsistent combination (parallel sizes that do not divide,
an eval larger than the run) is a `ConfigError` that names the key and says what is allowed. A section is the
dataclass its consumer takes and owns, with its own rules (`check()`): `rollout` is the loop's
`rollverify.rollout.RolloutConfig`, `tools` the tool turns' `rollverify.tool_turns.ToolsConfig`, `algo` the
strategies' `rollverify.strategies.AlgoConfig`, `servers` the engine wing's `sglang_ext.config.ServersConfig`,
`trainer` the trainer wing's `megatron_bridge.config.TrainerConfig`; the run config composes them with the
application's own sections and checks the rules that span sections, so the file and the code share one
definition and nothing is copied or renamed between them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_bridge.config import TrainerConfig
from rollverify.app.presets import CONFIG_DIR, shipped_configs
from rollverify.app.recovery import RecoveryConfig
from rollverify.rollout import RolloutConfig
from rollverify.sections import ConfigError, bounded, build, coerce, suggest
from rollverify.strategies import AlgoConfig
from rollverify.tool_turns import ToolsConfig
from sglang_ext.config import ServersConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_override", "apply_overrides", "find_config",
           "shipped_configs", "SECTIONS"]


Dtype = Literal["auto", "float32", "bfloat16"]


@dataclass
class ModelConfig:
    """The policy: a local HF checkpoint (`path`), or the project's tiny model when `path` is null."""

    path: str | None = None  # local folder with config.json + safetensors; never downloaded
    dtype: Dtype = "auto"  # auto: float32 on CPU, bfloat16 on GPU (engine and trainer alike)
    # --- tiny model (path: null) ---
    moe: bool = False  # tiny Qwen3-MoE (8 experts, top-2) instead of dense Qwen3
    tiny_seed: int = bounded(0, ge=0)
    task: str | None = "auto"  # warm-start task; auto: task.name when it is synthetic; null: no warm start
    tiny_overrides: dict[str, Any] = bounded(factory=dict)  # other TinyModelSpec fields, e.g. {hidden_size: 128}
    # `rollverify plan` where model.path/config.json is not on this machine: a preset (rollverify.app.presets.ARCH_PRESETS:
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

    name: str = "countdown"  # a registered task (rollverify.tasks.task_names(); an unknown name's error lists them)
    options: dict[str, Any] = bounded(factory=dict)  # task arguments, e.g. {train_path: data/dapo.parquet}
    # A reward function instead of the task's own: module:function or path/to/file.py:function, called as
    # fn(prompt, response, label) -> float (rollverify.tasks.reward)
    reward: str | None = None


@dataclass
class ClusterConfig:
    """Where the trainer ranks and servers run; `rollverify plan` places them, the launchers start them there."""

    launcher: Literal["local", "ray"] = "local"  # local: processes on this machine; ray: Ray actors on a cluster
    nodes: int = bounded(1, ge=1)
    gpus_per_node: int = bounded(0, ge=0)  # 0: CPU only
    placement: Literal["colocated", "disaggregated"] = "colocated"  # colocated: rollout and training take turns
    rollout_gpus: int = bounded(0, ge=0)  # disaggregated: the last GPUs go to the servers, the rest to the trainer
    gpu_memory_gib: float = bounded(80.0, gt=0.0)  # per GPU, as `plan` budgets it
    # host RAM per node, as `plan` budgets it (rollverify.app.host_memory): refused above 95 %, where Ray's memory
    # monitor kills workers
    host_memory_gib: float = bounded(1024.0, gt=0.0)
    # the network interface of gloo's and NCCL's sockets on nodes with several (GLOO_SOCKET_IFNAME,
    # NCCL_SOCKET_IFNAME in every trainer rank and server); null: their own choice
    socket_ifname: str | None = None
    # --- ray launcher (rollverify.app.cluster) ---
    address: str | None = None  # Ray cluster to join (auto, HEAD_IP:6379); null: RAY_ADDRESS, else a one-node Ray here
    join_timeout_s: float = bounded(120.0, gt=0.0)  # nodes, placement group and file checks that take longer fail
    log_to_driver: bool = True  # actors' stdout/stderr (trainer ranks, server actors) echoed by the driver

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class EvalConfig:
    """Evaluation with the current policy (`rollverify.app.evaluate`): the task's held-out split, or named sets."""

    every: int = bounded(10, ge=0)  # steps between evaluations (and at the last step); 0: never
    n_prompts: int = bounded(64, ge=1)  # prompts of the held-out split; sets are evaluated whole
    # Benchmark files in the project's layout (tools/prepare_data.py), by name: {aime24: data/aime24.parquet,
    # math500: {path: data/math500.jsonl, prompt_key: problem, label_key: answer}}; empty: the held-out split
    sets: dict[str, Any] = bounded(factory=dict)
    n_samples: int = bounded(1, ge=1)  # k responses per prompt: eval/<set>/avg@k and pass@k
    temperature: float = bounded(1.0, gt=0.0)
    max_new_tokens: int | None = bounded(None, ge=1)  # null: rollout.max_new_tokens
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
    checkpoint_every: int = bounded(0, ge=0)  # steps between checkpoints (DIR/checkpoint); 0: never
    export_every: int = bounded(0, ge=0)  # steps between Hugging Face exports (DIR/hf/step_N); 0: none during the run
    export_final: bool = True  # DIR/hf/step_N of the last step at the end of the run


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "rollout": RolloutConfig,
    "servers": ServersConfig,
    "tools": ToolsConfig,
    "algo": AlgoConfig,
    "trainer": TrainerConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "cluster": ClusterConfig,
    "recovery": RecoveryConfig,
}
TOP_LEVEL = ("seed",)


@dataclass
class RunConfig:
    """One run: the sections above plus the seed every random choice derives from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    servers: ServersConfig = field(default_factory=ServersConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def absolute_paths(self) -> RunConfig:
        """Every local path the run reads (`model.path`, `task.options` `*path` keys, `eval.sets`) made absolute
        here, on the driver, before any node checks it: a relative path means the same file wherever a server or
        trainer rank runs (Ray workers start in folders of their own). Returns self."""
        def absolute(value: str) -> str:
            return str(Path(value).expanduser().absolute())

        m = self.model
        if m.path is not None:
            m.path = absolute(m.path)
        for key, value in self.task.options.items():
            if key.endswith("path") and isinstance(value, str):
                self.task.options[key] = absolute(value)
        for name, spec in self.eval.sets.items():
            if isinstance(spec, str):
                self.eval.sets[name] = absolute(spec)
            elif isinstance(spec, dict) and isinstance(spec.get("path"), str):
                spec["path"] = absolute(spec["path"])
        return self

    def check_installed(self) -> None:
        """What the run needs where it starts that validation does not require (so that `rollverify plan`
        reads any config on any machine): CUDA on this machine for a GPU run of the local launcher (the Ray
        launcher checks every node before it reserves anything), SGLang's memory saver for a colocated GPU run."""
        if self.cluster.gpus_per_node and self.cluster.launcher == "local":
            from rollverify.devices import cuda_problem

            problem = cuda_problem()
            if problem is not None:
                raise ConfigError(f"cluster.gpus_per_node: {self.cluster.gpus_per_node}, but {problem}")
        if self.servers.engine_args.enable_memory_saver and importlib.util.find_spec("torch_memory_saver") is None:
            raise ConfigError(
                "servers.engine_args.enable_memory_saver: a colocated GPU run hands each GPU between the SGLang "
                "servers and the trainer through SGLang's memory saver (release_memory_occupation does nothing "
                "without it), which needs the torch_memory_saver package; it is not installed here. Install "
                "sglang's GPU requirements (requirements/gpu.txt), or run with cluster.placement=disaggregated"
            )

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
                    f"unknown config section {key!r}{suggest(key, allowed)}; allowed: {', '.join(allowed)}"
                )
        kw: dict[str, Any] = {}
        for name, cls_ in SECTIONS.items():
            section = raw.get(name) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{name}: expected a mapping of settings, got {section!r}")
            kw[name] = build(cls_, section, name)
        if "seed" in raw:
            kw["seed"] = coerce(raw["seed"], int, "seed")
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
                m.tiny_overrides[k] = coerce(v, hints[k], f"model.tiny_overrides.{k}")
        r.check()  # each section its own rules, then the rules between sections
        self.servers.check()
        self.tools.check()
        t.check()
        self._check_concurrency()
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
        self._check_cluster()
        if self.log.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "log.wandb: true needs the wandb package, which is not installed; set log.wandb=false"
            )

    def _check_cluster(self) -> None:
        """Cluster keys that contradict each other (what fits on the cluster is `rollverify plan`'s check)."""
        from rollverify.app.presets import ARCH_PRESETS

        c, m = self.cluster, self.model
        if m.arch is not None:
            if m.path is None:
                raise ConfigError("model.arch: the tiny model's architecture comes from its spec; set model.path too")
            if isinstance(m.arch, str) and m.arch not in ARCH_PRESETS:
                raise ConfigError(
                    f"model.arch: unknown preset {m.arch!r}{suggest(m.arch, list(ARCH_PRESETS))}; presets: "
                    f"{', '.join(ARCH_PRESETS)}, or a mapping of the model's config.json fields"
                )
        if c.launcher == "local" and c.nodes > 1:
            raise ConfigError(
                f"cluster.nodes: the local launcher runs on this machine only, got {c.nodes} nodes; "
                "set cluster.launcher=ray"
            )
        self._check_schedule()
        if self.trainer.offload_between_phases and (c.launcher, c.placement) != ("ray", "colocated"):
            raise ConfigError(
                f"trainer.offload_between_phases: only a colocated Ray run hands GPU memory between trainer and "
                f"servers (here launcher {c.launcher}, placement {c.placement}: the servers keep their memory, so "
                f"nothing would use what the trainer frees); set it to null or false"
            )
        ea = self.servers.engine_args
        if (c.launcher, c.placement) == ("ray", "colocated") and c.gpus_per_node and self.servers.launched:
            # the servers release their GPU memory for the trainer's phases (rollverify.app.handoff); SGLang does
            # that only through its memory saver (a no-op adapter otherwise)
            if ea.enable_memory_saver is False:
                raise ConfigError(
                    "servers.engine_args.enable_memory_saver: false, but a colocated GPU run needs it (the servers "
                    "release their memory to the trainer through it); drop the key or set cluster.placement="
                    "disaggregated")
            ea.enable_memory_saver = True
        if c.placement == "colocated" and c.rollout_gpus:
            raise ConfigError(
                f"cluster.rollout_gpus: colocated servers share every GPU with the trainer, got {c.rollout_gpus}; "
                "set it to 0 or cluster.placement=disaggregated"
            )
        if c.placement == "disaggregated" and (c.gpus or c.rollout_gpus) and not 0 < c.rollout_gpus < c.gpus:
            raise ConfigError(
                f"cluster.rollout_gpus: disaggregated needs GPUs for both sides, 0 < rollout_gpus < "
                f"nodes*gpus_per_node = {c.gpus}, got {c.rollout_gpus}"
                + ("" if c.gpus else " (on CPU, gpus_per_node 0, leave it 0: servers and ranks are processes)")
            )

    def _check_concurrency(self) -> None:
        """What the loop keeps generating (`rollout.max_live`) the servers it launches run at once: beyond their
        `max_running_requests` the rest would wait in SGLang's queues, live to the loop but not generating (servers
        given by endpoints are sized by whoever runs them)."""
        s, r = self.servers, self.rollout
        cap = s.engine_args.max_running_requests
        if cap is None or not s.launched or r.max_live <= s.launched * cap:
            return
        need = -(-r.max_live // s.launched)
        raise ConfigError(
            f"rollout.max_live: {r.max_live} responses generating at once need more than servers.count x "
            f"servers.engine_args.max_running_requests = {s.launched} x {cap} = {s.launched * cap} (the rest would "
            f"wait in SGLang's queue, not generate): lower rollout.max_live to {s.launched * cap}, raise "
            f"servers.engine_args.max_running_requests to {need}, or launch more servers")

    def _check_schedule(self) -> None:
        """The asynchronous schedule needs the servers and the trainer on their own devices at once."""
        c, a = self.cluster, self.algo
        if a.schedule != "async":
            return
        if c.gpus == 1:
            raise ConfigError(
                "algo.schedule: async needs the servers and the trainer on separate GPUs, but the cluster has one "
                "(cluster.nodes*gpus_per_node = 1): add GPUs (cluster.rollout_gpus of them for the servers), or "
                "algo.schedule=alternating"
            )
        if c.placement != "disaggregated":
            raise ConfigError(
                "algo.schedule: async generates while the trainer trains, so each side needs its own devices, but "
                f"cluster.placement is {c.placement}: set cluster.placement=disaggregated (on GPUs with "
                "cluster.rollout_gpus for the servers), or algo.schedule=alternating"
            )
        if a.queue_groups and a.queue_groups < self.rollout.batch_groups:
            raise ConfigError(
                f"algo.queue_groups: {a.queue_groups} finished groups would never fill a step of "
                f"rollout.batch_groups = {self.rollout.batch_groups}: set it >= {self.rollout.batch_groups} or 0"
            )

    def _check_reward_and_eval(self, check_task: bool) -> None:
        """task.reward imports, the chat template the tokenizer must have, eval.sets' entries; with
        `check_task`, also the reward function and the sets' files (both are read, like the task's data)."""
        from rollverify.tasks.chat import has_chat_template
        from rollverify.tasks.reward import load_reward
        from rollverify.tasks.sets import load_eval_sets, parse_eval_sets

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
        return RunConfig.from_dict(apply_overrides(raw, list(overrides)), check_task=check_task).absolute_paths()
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None
