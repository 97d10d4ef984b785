"""`rollverify train`: a run's story, start to end (docs/architecture.md draws its processes and threads).

`train` checks the config against its cluster and claims the run folder before anything starts; `Run` starts
(or connects to) the SGLang servers, then the trainer's ranks, pushes the first weights and builds the schedule
over the run's `Rollout` (`_make_loop`); a resumed run restores its checkpoint (`Run.restore`); `run_steps`
runs the steps: each is the schedule's (rollout -> train -> verify -> resync, `Loop.run_step` or
`AsyncLoop.run_step`), then evaluation, the metrics record, a checkpoint and an export when due, all of it inside
`Supervisor.recovering` (a trainer fault: new ranks from the last checkpoint, the steps after it redone); `close`
stops what the run started. The wings are imported inside functions, so that `rollverify --help` and the config
checks start fast: `start_engine` and `start_trainer` are how `rollverify eval` and `rollverify export` build
theirs too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from rollverify.app import rundir
from rollverify.app.checkpoints import LOOP_FILE, CheckpointStore
from rollverify.app.config import RunConfig, load_config, shipped_configs
from rollverify.app.console import Progress, quiet_cpu_warnings, say, stage
from rollverify.app.evaluate import build_evaluator
from rollverify.app.export import export_dir, export_trainer
from rollverify.app.recovery import LEDGER_PREFIX, RunStopped, Supervisor, resume_command
from rollverify.app.start import build_tool_turns, resolve_model, start_engine, start_trainer
from rollverify.async_loop import AsyncLoop
from rollverify.buffer import RolloutBuffer
from rollverify.loop import Loop
from rollverify.metrics import MetricsWriter
from rollverify.rollout import Rollout
from rollverify.tasks import get_task
from rollverify.tasks.chat import PromptRenderer
from rollverify.tasks.reward import task_reward
from rollverify.types import Group, Response

CKPT = rundir.CHECKPOINT


class Run:
    """Everything one training run holds; `close` releases servers and trainer ranks."""

    def __init__(self, cfg: RunConfig, out: Path) -> None:
        from transformers import AutoTokenizer

        from rollverify.app.gpu_memory import MemoryBook
        from rollverify.app.handoff import make_handoff, start_run
        from rollverify.app.plan import make_plan

        self.cfg, self.out = cfg, out
        self.checkpoints = CheckpointStore(out)
        self.resumed_from: Path | None = None  # the run folder whose checkpoint this one continued from
        self.model_path = resolve_model(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.task = get_task(cfg.task.name, **cfg.task.options)
        self.score = task_reward(self.task, cfg.task.reward)
        self.tools = build_tool_turns(cfg, self.task, self.tokenizer)  # None: a single-turn task
        self.render = PromptRenderer(self.tokenizer, getattr(self.task, "chat_template", "auto"), source=self.model_path,
                                     tools=self.tools.schemas() if self.tools else None)
        self.evaluator = build_evaluator(cfg, self.task, self.tokenizer, self.score, self.tools) \
            if cfg.eval.every else None
        self.cluster = None  # rollverify.app.cluster.RayCluster with cluster.launcher: ray
        self.plan = make_plan(cfg).check()
        # every GPU's holders, recorded where the run asks for the memory (rollverify.app.gpu_memory)
        self.book = MemoryBook(self.plan)
        self.handoff = make_handoff(cfg, self.book)
        try:
            self.engine, self.trainer, weights = start_run(cfg, self.handoff, self._start_engine,
                                                           self._staged_trainer, self._servers_side,
                                                           self._weight_sync)
        except BaseException:
            self._close_cluster()
            raise
        try:
            self._serve_restarted_servers(weights)
            if cfg.servers.endpoints:
                self.engine.update_weights(self.trainer.export_weights(), 0)
        except BaseException:
            self.close()
            raise
        self._train_examples: list = []
        self._stream = self.task.stream("train", seed=cfg.seed)
        self.loop = self._make_loop(weights)

    # --- wiring -------------------------------------------------------------------------------------------

    def _start_engine(self):
        if self.cfg.cluster.launcher == "ray":  # trainer ranks and servers as actors of one placement group
            from rollverify.app.cluster import RayCluster, files_read
            from rollverify.app.ray_placement import start_ray_engine

            with stage("ray cluster") as st:
                self.cluster = RayCluster.start(self.plan, files_read(self.cfg, self.model_path), shared=self.out)
                self.checkpoints.remove_elsewhere = self.cluster.remove_on_every_node
                st.detail = ", ".join(self.cluster.node_name(k) for k in range(len(self.cluster.nodes)))
            try:
                with stage("servers") as st:
                    engine = start_ray_engine(self.cfg, self.cluster, self.model_path, self.out, self.book)
                    st.detail = f"{len(self.cluster.plan.servers)} SGLang server actor(s), CURVE keys of this run"
                return engine
            except BaseException:
                self._close_cluster()
                raise
        return start_engine(self.cfg, self.model_path, self.out, self.book)

    def _servers_side(self, engine):
        """The handoff's server side: the engine's live servers release and resume their memory."""
        from rollverify.app.weight_transport import ServersMemory

        return ServersMemory(engine, self.cfg.servers.timeout_s)

    def _staged_trainer(self):
        with stage("trainer") as st:
            trainer = self._start_trainer()
            st.detail = f"Megatron-Core, world size {self.cfg.trainer.world_size}"
        return trainer

    def _weight_sync(self, engine, trainer):
        """The run's `WeightSync` (rollverify.app.handoff.make_weights)."""
        from rollverify.app.handoff import make_weights

        return make_weights(self.cfg, engine, trainer, self.handoff)

    def _serve_restarted_servers(self, weights) -> None:
        """A restarted server gets the current trainer's policy through this process (the local launcher) or
        through the run's transport."""
        self.engine.restart_weights(source=self.trainer.export_weights)
        if hasattr(weights, "restore"):
            self.engine.restart_weights(restore=weights.restore)

    def _make_loop(self, weights) -> Loop | AsyncLoop:
        """A fresh schedule of the configured kind over a new `Rollout` of the current engine, trainer and
        weight sync."""
        from rollverify.app.handoff import MeteredTrainer

        cfg = self.cfg
        trainer = MeteredTrainer(self.trainer, self.book, measure=cfg.cluster.gpus_per_node > 0)
        rollout = Rollout(cfg.rollout, self.engine, trainer, self.make_group, self.reward, weights=weights,
                          tools=self.tools)
        return AsyncLoop(cfg.algo, rollout) if cfg.algo.schedule == "async" else Loop(cfg.algo, rollout)

    def _start_trainer(self):
        from megatron_bridge.loop_adapter import LoopTrainer

        if self.cluster is not None:
            from rollverify.app.ray_placement import start_ray_trainer

            return LoopTrainer(start_ray_trainer(self.model_path, self.cfg.trainer, self.cluster,
                                                 dtype=self.cfg.model.dtype, seed=self.cfg.seed,
                                                 setup=quiet_cpu_warnings))
        return LoopTrainer(start_trainer(self.cfg, self.model_path))

    def _close_cluster(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def make_group(self, group_id: int) -> Group:
        while len(self._train_examples) <= group_id:  # group ids index the task's train stream
            self._train_examples.append(next(self._stream))
        ex = self._train_examples[group_id]
        prompt = self.render.ids(ex)
        r = self.cfg.rollout
        return Group.new(group_id, prompt, r.n, r.max_new_tokens, uid=ex.uid, prompt=ex.prompt, label=ex.label)

    def reward(self, group: Group, response: Response) -> float:
        text = self.tokenizer.decode(response.token_ids.tolist(), skip_special_tokens=False)
        return float(self.score(group.metadata["prompt"], text, group.metadata["label"]))

    def step(self) -> dict:
        """One step of the schedule and its record, with the books that audit a run across restarts: the group
        ids it trained, the ledger whole under ledger/."""
        result = self.loop.run_step()
        return {**result.metrics, "trained_groups": [g.group_id for g in result.trained_groups],
                **{LEDGER_PREFIX + k: v for k, v in asdict(self.loop.ledger).items()}}

    def evaluate(self) -> dict[str, float]:
        """avg@k and pass@k of every eval set and `eval_reward`, sampled with the current weights."""
        assert self.evaluator is not None, "eval.every is 0"
        return self.evaluator.run(self.engine, tag=f"eval{self.loop.step}")

    def not_evaluated(self) -> dict[str, float]:
        """The evaluation's keys, null, for a step that does not evaluate (none when eval.every is 0)."""
        return self.evaluator.not_run() if self.evaluator is not None else {}

    def export(self) -> Path:
        """The current policy as a Hugging Face folder DIR/hf/step_N (colocated: while the servers have released
        their KV pool, rollverify.app.handoff)."""
        from rollverify.app.handoff import EXPORT_KINDS

        with self._trainer_turn("export", EXPORT_KINDS, bucket=True):
            return export_trainer(self.trainer, self.model_path, export_dir(self.out, self.loop.step))

    def _trainer_turn(self, phase: str, kinds: tuple[str, ...], bucket: bool = False):
        if self.handoff.colocated:
            self.loop.pause_engines()  # a server releases memory only while idle
        return self.handoff.trainer_turn(phase, kinds, bucket=bucket)

    # --- checkpoints --------------------------------------------------------------------------------------

    def save(self) -> None:
        """A checkpoint of the current step, current once complete (`CheckpointStore.save`; CheckpointError
        when it cannot be written, the previous one kept)."""
        from rollverify.app.handoff import CHECKPOINT_KINDS

        if self.tools is not None:  # the buffer holds every call's output: none runs again after a restore
            self.loop.settle_tools()

        def write(d: Path) -> None:
            with self._trainer_turn("checkpoint", CHECKPOINT_KINDS):
                self.trainer.save(str(d / "trainer"))
            self.loop.buffer.save(d / "buffer.npz")

        self.checkpoints.save(self.loop.step, write, self.loop.state())

    def restore(self, src: Path) -> None:
        d = src / CKPT
        if not (d / LOOP_FILE).is_file():
            raise FileNotFoundError(f"--resume {src}: no {CKPT}/{LOOP_FILE} there (was it a run directory?)")
        if Path(src).resolve() == self.out.resolve():
            self.checkpoints.clean()  # what a save that never finished left behind
        from rollverify.app.handoff import CHECKPOINT_KINDS

        with self._trainer_turn("restore", CHECKPOINT_KINDS):
            self.trainer.load(str(d / "trainer"))
        self.loop.restore(json.loads((d / LOOP_FILE).read_text()), RolloutBuffer.load(d / "buffer.npz"))
        self.resumed_from = Path(src)
        # the engines start from the initial weights (or hold another policy): bring them to the restored one,
        # the run's own way
        self.loop.weights.push(self.loop.version)

    def restart_trainer(self) -> int:
        """After a trainer fault: the old ranks killed, new ones from the last checkpoint of this run (none: the
        one it resumed from, else the initial weights), the engines holding nothing of the lost steps and
        serving the restored policy, the loop restored with the checkpoint's buffer. Returns the step it
        restored. The new ranks start in `start_run`'s order (`Handoff.restart`: colocated servers release their
        memory, the ranks are built and offloaded, the restore's push gives the servers their memory back)."""
        from rollverify.app.recovery import forget_responses

        self.close_trainer()
        self.loop.close()  # the asynchronous schedule's trainer thread ends with the failed call
        if self.tools is not None:  # calls in flight belong to the lost steps' responses
            self.tools.abandon()
        forget_responses(self.engine)  # the servers idle, so that the new ranks start as the first did
        self.trainer = self.handoff.restart(self._staged_trainer)
        weights = self._weight_sync(self.engine, self.trainer)
        self._serve_restarted_servers(weights)
        self.loop = self._make_loop(weights)
        src = self.out if self.checkpoints.current() is not None else self.resumed_from
        if src is not None:
            self.restore(src)
        else:
            self.loop.weights.push(0)
        return self.loop.step

    def close_trainer(self) -> None:
        """Stop the trainer's ranks at once (a broken group's collectives are never waited for)."""
        ranks = self.trainer.ranks
        if ranks is not None:
            ranks.close(force=True)
        else:
            self.trainer.close()

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
        try:
            if hasattr(self, "loop"):  # a run that failed to start has none
                self.loop.close()  # the asynchronous schedule: the engines paused, its worker thread ended
        finally:
            try:
                self.trainer.close()
            finally:
                try:
                    self.engine.close(shutdown=not self.cfg.servers.endpoints)
                finally:
                    self._close_cluster()


def train(
    cfg: RunConfig,
    out: str | Path,
    resume: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    bar: bool | None = None,
) -> dict:
    """Run `cfg.trainer.steps` steps into `out`; returns the summary. `progress`: a bar on a terminal (or as
    `bar` says), else one line per step.

    Before anything starts or is written, a config that does not fit its cluster (`rollverify.app.plan.check`)
    raises PlanError, and a run folder or input file that is not usable a RunFolderError / ConfigError naming
    what is wrong."""
    from rollverify.app.plan import check as check_plan

    cfg.absolute_paths()
    check_plan(cfg)
    cfg.check_paths()
    cfg.check_installed()
    out = rundir.claim(Path(out).expanduser().absolute(), resume=resume, overwrite=overwrite)
    quiet_cpu_warnings()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    run = Run(cfg, out)  # servers, trainer ranks, the first weights, the schedule over the run's Rollout
    t_start = time.perf_counter()
    try:
        if resume is not None:
            run.restore(Path(resume))  # the checkpoint's trainer, buffer and loop state; the servers get its policy
        writer = MetricsWriter(
            out,
            cfg.log,
            resume_step=run.loop.step if resume is not None else None,
            source=resume,
            config=cfg.to_dict(),
        )
        shown = Progress(cfg.trainer.steps, run.loop.step, bar=bar) if progress else None
        supervisor = Supervisor(run, writer, resume_command(out))
        run_steps(run, writer, supervisor, shown.update if shown is not None else None)
        if shown is not None:
            shown.close()
        summary = writer.close(extra={"wall_s": time.perf_counter() - t_start, "ledger": asdict(run.loop.ledger),
                                      "faults": supervisor.summary()})
    finally:
        run.close()
    return summary


def run_steps(run: Run, writer: MetricsWriter, supervisor: Supervisor,
              on_step: Callable[[dict], None] | None = None) -> None:
    """The run's steps up to `trainer.steps` (see the module docstring); `on_step` gets each step's record."""
    cfg = run.cfg
    while run.loop.step < cfg.trainer.steps:
        with supervisor.recovering():
            metrics = run.step()  # rollout -> train -> verify -> resync
            step, last = run.loop.step, run.loop.step == cfg.trainer.steps
            due = cfg.eval.every and (step % cfg.eval.every == 0 or last)
            metrics.update(run.evaluate() if due else run.not_evaluated())
            writer.write(metrics)
            if cfg.log.checkpoint_every and step % cfg.log.checkpoint_every == 0:
                supervisor.checkpoint()
            if (cfg.log.export_every and step % cfg.log.export_every == 0) or (last and cfg.log.export_final):
                run.export()
            if on_step is not None:
                on_step(metrics)


DESCRIPTION = """\
Train a policy with GRPO-style RL: SGLang generates rollouts, Megatron-Core trains. With algo.mode partial or
rollverify, responses still unfinished when a step's batch is full are carried over to the next step; rollverify
checks them against the new policy and resumes only their verified prefix.

The run folder (--out) gets config.json, metrics.jsonl (one line per step), summary.json, plots/, tensorboard/,
server logs and, every log.checkpoint_every steps, checkpoint/ (what --resume continues from). A folder that
already holds a run is refused unless you pass --resume (continue it) or --overwrite (replace it)."""

EPILOG = """\
examples:
  rollverify train --config tiny_cpu --out runs/rv
  rollverify train --config tiny_cpu --out runs/partial algo.mode=partial trainer.steps=40 seed=1
  rollverify train --config my.yaml --out runs/x model.path=/models/Qwen3-8B task.name=math \\
      task.options.train_path=data/dapo.parquet
  rollverify train --config tiny_cpu --resume runs/rv trainer.steps=80   # continue runs/rv up to step 80
  rollverify train --resume runs/rv        # continue runs/rv with its own config.json (e.g. after a crash)"""


def cli_main(argv: list[str] | None = None) -> int:
    from sglang_ext.launch import ServerStartError

    p = argparse.ArgumentParser(
        prog="rollverify train",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"YAML config file, or the name of a shipped one ({', '.join(shipped_configs())}; tiny_cpu is the CPU "
        "default); with --resume it defaults to the run's own config.json",
    )
    p.add_argument("--out", default=None, help="run folder to write: new or empty (default with --resume: that run)")
    p.add_argument("--resume", default=None, metavar="RUN", help="continue the run in folder RUN from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace the run that --out holds")
    p.add_argument(
        "--no-progress", action="store_true", help="no per-step output (default: a bar on a terminal, else a line a step)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. algo.mode=partial seed=1")
    a = p.parse_args(argv)
    if a.out is None and a.resume is None:
        p.error("--out is required (or --resume RUN to continue that run in its folder)")
    if a.config is None:
        if a.resume is None:
            p.error("--config is required (with --resume it defaults to the run's config.json)")
        a.config = str(Path(a.resume) / "config.json")
    out = a.out if a.out is not None else a.resume
    try:  # what the user gave is checked before any server or trainer starts and before anything is written
        cfg = load_config(a.config, a.overrides)
        cfg.check_paths()
        cfg.check_installed()
        if not a.overwrite:  # cheap, so first; with --overwrite, train() checks the folder and then clears it
            rundir.claim(out, resume=a.resume)
        from rollverify.app.plan import check as check_plan

        check_plan(cfg)  # what `rollverify plan` refuses stops here (train() checks again for API callers)
        summary = train(cfg, out, a.resume, progress=not a.no_progress, overwrite=a.overwrite)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ServerStartError as e:  # its message carries the server log's tail
        print(f"error: the SGLang server did not start: {e}", file=sys.stderr)
        return 3
    except RunStopped as e:  # it names what failed and the command that resumes the run
        print(f"error: {e}", file=sys.stderr)
        return 4
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict | list)}, indent=1))
    say(f"run folder: {out}")
    return 0
