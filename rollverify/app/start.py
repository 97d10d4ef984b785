"""How the application starts the two wings for a run, an evaluation or an export: the policy's checkpoint
(`resolve_model`), the Megatron trainer (`start_trainer`) and the SGLang rollout engine (`start_engine`) of the
local launcher (the Ray launcher's are rollverify.app.ray_placement's). The wings are imported inside the
functions, so that the command line starts fast."""

from __future__ import annotations

import os
from pathlib import Path

from rollverify.app.config import RunConfig
from rollverify.app.console import quiet_cpu_warnings, stage


def resolve_model(cfg: RunConfig) -> Path:
    """A local checkpoint folder, or the cached tiny model (warm-started on the task) of the CPU default."""
    if cfg.model.path:
        cfg.check_paths()
        return Path(cfg.model.path).expanduser()
    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

    with stage("tiny model") as st:
        path = ensure_tiny_model(TinyModelSpec(**cfg.model.tiny_spec()))
        st.detail = str(path)
    return path


class TokenizerCodec:
    """A Hugging Face tokenizer as the tool turns' `TextCodec` (special tokens are text both ways)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def build_tool_turns(cfg: RunConfig, task, tokenizer):
    """The tool turns of a multi-turn task (its `tool_registry()`, narrowed to `tools.names`), or None for a task
    without tools; a name the task does not offer is a ConfigError naming the ones it does."""
    from rollverify.environment.tools import ToolRegistry
    from rollverify.sections import ConfigError
    from rollverify.tool_turns import ToolTurns

    offered = task.tool_registry() if hasattr(task, "tool_registry") else None
    names = cfg.tools.names
    if offered is None:
        if names:
            raise ConfigError(f"tools.names: task {cfg.task.name!r} offers no tools; set tools.names=[]")
        return None
    if names:
        unknown = [n for n in names if offered.get(n) is None]
        if unknown:
            raise ConfigError(f"tools.names: task {cfg.task.name!r} offers no tool {unknown}; it offers "
                              f"{offered.names()}")
        offered = ToolRegistry([offered.get(n) for n in names])
    return ToolTurns(cfg.tools, offered, TokenizerCodec(tokenizer))


def use_run_env(cfg: RunConfig) -> None:
    """The local launcher's processes (this one, its trainer ranks, its servers) get the run's environment
    (`rollverify.devices.run_env`): the device the config chose, so that none falls back to the CPU where it
    configured GPUs, and the sockets' interface."""
    from rollverify.devices import run_env

    os.environ.update(run_env(cfg.cluster.gpus_per_node, cfg.cluster.socket_ifname))


def start_trainer(cfg: RunConfig, model_path: Path, world_size: int | None = None):
    """The Megatron trainer of `cfg` on `model_path` (`world_size` ranks, default `trainer.world_size`): a
    `MegatronTrainer` in this process at world size 1, else a `TrainerProxy` over child-process ranks
    (`rollverify train`, `export`)."""
    from megatron_bridge.spawned import make_trainer

    use_run_env(cfg)
    ranks = cfg.trainer.world_size if world_size is None else world_size
    return make_trainer(model_path, cfg.trainer, world_size=ranks, dtype=cfg.model.dtype, seed=cfg.seed,
                        setup=quiet_cpu_warnings)


def start_engine(cfg: RunConfig, model_path: Path, log_dir: Path, book=None):
    """The rollout engine: `servers.endpoints` (cleared; the caller pushes its weights) or `servers.count`
    servers launched on `model_path`, logging to `log_dir`/server<i>.log (`rollverify train` and `eval`); a
    launch that takes longer than `servers.startup_s` is stopped. `book` (rollverify.app.gpu_memory):
    each server's memory is recorded when it serves."""
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server
    from sglang_ext.rollout_engine import SGLangRolloutEngine

    s = cfg.servers
    if s.endpoints:  # servers someone else runs: clear them
        with stage("servers") as st:
            engine = SGLangRolloutEngine(s.endpoints, timeout_s=s.timeout_s)
            engine.reset()
            st.detail = f"connected to {', '.join(s.endpoints)}"
        return engine
    use_run_env(cfg)
    cpu_compat.activate()

    def launch(i: int):
        server = launch_server(model_path, engine_args=s.engine_args.args(), log_path=log_dir / f"server{i}.log",
                               startup_timeout_s=s.startup_s)
        if book is not None:
            book.server_started(i)
        return server

    servers = []
    try:
        for i in range(s.count):
            with stage("server" if s.count == 1 else f"server {i}") as st:
                servers.append(launch(i))
                st.detail = f"SGLang at {servers[-1].endpoint} (log: {log_dir / f'server{i}.log'})"
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return SGLangRolloutEngine(
        [server.endpoint for server in servers], processes=servers, relaunch=launch, timeout_s=s.timeout_s
    )
