"""`Handoff`: the order in which colocated servers and trainer ranks take and give back their GPUs, and the
ledger entries of each step (rollverify.app.gpu_memory.MemoryBook).

Start-up (`start`, then the first `push`), slime's order on SGLang 0.5.23's memory saver:

    servers start (weights, KV pool, CUDA graphs)  ->  servers release all three  ->  trainer built (DDP buffers,
    optimizer)  ->  trainer offloads params, grads, optimizer  ->  servers resume weights  ->  first push (the
    released weights come back undefined; the push fills them, the trainer's params resident for it)  ->
    trainer offloads params  ->  servers resume KV pool and CUDA graphs

Every step: `before_training` (servers release all, trainer reloads), the training and verification calls
(`MeteredTrainer`), `push` (trainer offloads grads and optimizer, servers resume weights, buckets, trainer offloads
params, servers resume the rest; a push while the servers hold their KV pool, as after a restore, has them
release it and their CUDA graphs first). Checkpoint, export and restore (`trainer_turn`) bring the trainer's state
back only while the servers have released their KV pool and CUDA graphs (the weights stay), and give it back
before the servers resume. Without colocation (the local launcher, disaggregated GPUs) nothing is released or
offloaded: the same calls only record.

`replay_run` runs this order, one step of each phase, on sides that do nothing: `rollverify plan`'s peaks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rollverify.app.gpu_memory import SERVER_TAGS, TRAINER_KINDS, MemoryBook
from rollverify.rollout import InMemoryWeights

if TYPE_CHECKING:
    from rollverify.app.plan import Plan

T = TypeVar("T")
# what the trainer's calls need resident (megatron_bridge.trainer's `_needs`)
CHECKPOINT_KINDS = ("params", "optimizer")  # save_checkpoint, load_checkpoint
EXPORT_KINDS = ("params",)  # export_hf_state, iter_hf_tensors, send_weights, compute_logprobs


class ServerSide(Protocol):
    def memory(self, action: str, tags: list[str]) -> None:
        """Every live server releases or resumes the GPU memory of `tags`."""


class TrainerSide(Protocol):
    def offload(self, kinds: Sequence[str]) -> dict[str, float]: ...

    def reload(self) -> dict[str, float]: ...


class NullBook:
    """A book that records nothing (a transport used without a run's plan)."""

    enabled = False
    phase = ""

    def enter(self, phase: str) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in ("resident", "computing", "trainer_building", "trainer_turn"):
            return lambda *a, **k: contextlib.nullcontext()
        return lambda *a, **k: None


class Handoff:
    """The colocated order of releases, offloads, reloads and resumes (module docstring), recorded on `book`.

    `colocated`: the servers release their memory for the trainer's phases; `offloads`: the trainer offloads
    its state for the servers' (`trainer.offload_between_phases`); `measure` (a GPU run): after the trainer
    reloads and after it offloads, its rank 0's measured memory is held against the ledger. `servers` and
    `trainer` are set once they exist (`start` sets `trainer`)."""

    def __init__(self, book: MemoryBook | NullBook | None = None, *, colocated: bool, offloads: bool,
                 measure: bool = False) -> None:
        self.book = book if book is not None else NullBook()
        self.colocated, self.offloads, self.measure = colocated, offloads, measure
        self.servers: ServerSide | None = None
        self.trainer: TrainerSide | None = None
        self.released: list[str] = []  # the servers' tags released now

    # --- start-up -------------------------------------------------------------------------------------------

    def start(self, build: Callable[[], T]) -> T:
        """The trainer, built while the servers have released their memory, then offloaded (the first `push`
        gives the servers their memory back)."""
        self.book.enter("start")
        if self.colocated:
            self._servers("release", list(SERVER_TAGS))
        with self.book.trainer_building():
            trainer = build()
        if self.trainer is None:
            self.trainer = trainer  # type: ignore[assignment]
        if self.colocated and self.offloads:
            self._offload(TRAINER_KINDS)
        return trainer

    def restart(self, build: Callable[[], T]) -> T:
        """A trainer that replaces lost ranks (`Run.restart_trainer`), started as the first one was (`start`);
        the handoff offloads and reloads it from now on. The servers must hold no response (recovery's
        `forget_responses`), so that they can release their memory; the lost ranks' memory went with their
        processes."""
        self.trainer = None
        return self.start(build)

    # --- every step -----------------------------------------------------------------------------------------

    def before_training(self) -> None:
        """The rollout is over (servers paused): the trainer takes the GPUs."""
        self.book.enter("train")
        if not self.colocated:
            return
        self._servers("release", [t for t in SERVER_TAGS if t not in self.released])
        if self.offloads:
            assert self.trainer is not None
            self.trainer.reload()
            self.book.trainer_reloaded()
            self._measured()

    def push(self, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """`send` streams the trainer's weights to the servers, in the handoff's order; returns its statistics
        and the bytes the trainer released."""
        self.book.enter("sync")
        offloading = self.colocated and self.offloads
        released = self._offload(("grads", "optimizer")) if offloading else {}
        if offloading:  # the parameters come back for the send: not beside a KV pool (a restore's push)
            self._servers("release", [t for t in ("kv_cache", "cuda_graph") if t not in self.released])
        if "weights" in self.released:
            self._servers("resume", ["weights"])
        with self.book.resident(EXPORT_KINDS), self.book.computing("bucket"):
            stats = send()
        if offloading:
            released = {**released, **self._offload(("params",))}
            self._measured()
        self.book.enter("rollout")
        if self.released:
            self._servers("resume", list(self.released))
        return {**stats, **released}

    @contextlib.contextmanager
    def trainer_turn(self, phase: str, kinds: Iterable[str], *, bucket: bool = False) -> Iterator[None]:
        """A checkpoint, export or restore: the trainer's `kinds` come back for the block (the trainer's own
        `_needs`), colocated while the servers have released their KV pool and CUDA graphs (their weights stay).
        The servers must be idle (the loop's `pause_engines`)."""
        self.book.enter(phase)
        freed = [t for t in ("kv_cache", "cuda_graph") if t not in self.released] if (
            self.colocated and self.offloads) else []
        if freed:
            self._servers("release", freed)
        try:
            with self.book.resident(kinds), (self.book.computing("bucket") if bucket else contextlib.nullcontext()), \
                    self.book.trainer_turn(phase):
                yield
        finally:
            self.book.enter("rollout")
            if freed:
                self._servers("resume", freed)

    # --- sides ----------------------------------------------------------------------------------------------

    def _servers(self, action: str, tags: list[str]) -> None:
        if not tags:
            return
        assert self.servers is not None, "Handoff.servers is not set"
        self.servers.memory(action, tags)
        if action == "release":
            self.released += [t for t in tags if t not in self.released]
            self.book.servers_released(tags)
        else:
            self.released = [t for t in self.released if t not in tags]
            self.book.servers_resumed(tags)

    def _measured(self) -> None:
        """On CUDA: what the trainer's rank 0 measures, held against the ledger (`MemoryBook.compare`)."""
        if self.measure and self.book.enabled and self.trainer is not None:
            self.book.compare(0, self.trainer.memory_report())

    def _offload(self, kinds: Sequence[str]) -> dict[str, float]:
        assert self.trainer is not None
        out = self.trainer.offload(tuple(kinds))
        self.book.trainer_offloaded(kinds)
        return out


class MeteredTrainer:
    """The loop's trainer with its working memory on the book: training (activations) and the log-probs of
    verification (a no-grad forward), with the state each call needs resident. On CUDA every call ends with
    the ranks' measured memory held against the ledger (`MemoryBook.compare`). Everything else is the
    wrapped trainer's."""

    def __init__(self, trainer: Any, book: MemoryBook | NullBook, *, measure: bool = False) -> None:
        self.trainer, self.book, self.measure = trainer, book, measure

    def train_step(self, *args: Any, **kwargs: Any) -> dict:
        if self.book.phase != "train":
            self.book.enter("train")
        with self.book.resident(TRAINER_KINDS), self.book.computing("train"):
            out = self.trainer.train_step(*args, **kwargs)
        self._measured()
        return out

    def old_logprobs(self, *args: Any, **kwargs: Any) -> list:
        """The train step's first pass computed ahead (the asynchronous schedule verifies with it): a no-grad
        forward, in the train phase."""
        if self.book.phase != "train":
            self.book.enter("train")
        with self.book.resident(EXPORT_KINDS), self.book.computing("forward"):
            out = self.trainer.old_logprobs(*args, **kwargs)
        self._measured()
        return out

    def compute_logprobs(self, *args: Any, **kwargs: Any) -> list:
        if self.book.phase == "train":
            self.book.enter("verify")
        with self.book.resident(EXPORT_KINDS), self.book.computing("forward"):
            out = self.trainer.compute_logprobs(*args, **kwargs)
        self._measured()
        return out

    def _measured(self) -> None:
        if self.measure and self.book.enabled:
            self.book.compare(0, self.trainer.memory_report())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)


# --- the replay `rollverify plan` prints ------------------------------------------------------------------------


class _Dry:
    """A server set or trainer that does nothing: the replay's sides."""

    def memory(self, action: str, tags: list[str]) -> None:
        pass

    def offload(self, kinds: Sequence[str] = TRAINER_KINDS) -> dict[str, float]:
        return {}

    def reload(self) -> dict[str, float]:
        return {}

    def send_weights(self, spec: Any, version: int, bucket_bytes: int | None = None) -> dict[str, float]:
        return {}

    def update_weights(self, buckets: Any, version: int) -> None:
        pass

    def export_weights(self) -> list:
        return []

    def committed(self, version: int) -> None:
        pass

    def close(self, shutdown: bool = True) -> None:
        pass

    def train_step(self, *a: Any, **k: Any) -> dict:
        return {}

    def compute_logprobs(self, *a: Any, **k: Any) -> list:
        return []


def make_weights(cfg: Any, engine: Any, trainer: Any, handoff: Handoff, *, live: Callable[[], list] | None = None):
    """The run's `WeightSync`: the cluster layout's transport (rollverify.app.weight_transport), or the local
    launcher's in-memory buckets (`rollverify.rollout.InMemoryWeights`), both in the handoff's order."""
    from rollverify.app.weight_transport import weight_sync_for

    c = cfg.cluster
    weights = weight_sync_for(c.launcher, c.placement, engine, trainer,
                              server_tp=cfg.servers.engine_args.tp_size,
                              trainer_ranks=cfg.trainer.world_size, timeout_s=cfg.servers.timeout_s,
                              handoff=handoff, live=live)
    return weights if weights is not None else InMemoryWeights(engine, trainer, handoff)


def make_handoff(cfg: Any, book: MemoryBook | NullBook) -> Handoff:
    """The handoff of `cfg`'s layout: colocated servers release their memory where the run has a transport
    that hands it over (a colocated Ray run), and the trainer offloads where `trainer.offload_between_phases`
    says."""
    from rollverify.app.weight_transport import transport_for

    c = cfg.cluster
    colocated = c.placement == "colocated" and transport_for(c.launcher, c.placement) == "ipc"
    return Handoff(book, colocated=colocated and not cfg.servers.endpoints,
                   offloads=cfg.trainer.offloads(c.launcher, c.placement), measure=c.gpus_per_node > 0)


def start_run(cfg: Any, handoff: Handoff, start_engine: Callable[[], Any], start_trainer: Callable[[], Any],
              servers_side: Callable[[Any], ServerSide], weight_sync: Callable[[Any, Any], Any]) -> tuple:
    """`rollverify train`'s start-up, in the order of the module docstring: the servers (each records its memory
    as it serves), the handoff's server side, the trainer (`Handoff.start`), the weight transport, the first
    push. Returns (engine, trainer, weights); what started is closed when a later step fails."""
    engine = start_engine()
    trainer = None
    try:
        handoff.servers = servers_side(engine)
        trainer = handoff.start(start_trainer)
        weights = weight_sync(engine, trainer)
        first_push(handoff, weights)
        return engine, trainer, weights
    except BaseException:
        try:
            if trainer is not None:
                trainer.close()
        finally:
            engine.close(shutdown=not cfg.servers.endpoints)
        raise


def replay(plan: Plan, *, bucket_bytes: int = 64 << 20) -> MemoryBook:
    """A book of `plan` (non-strict: every overflow is kept in `book.ledger.overflows`) after `replay_run`:
    what `rollverify plan` prints and refuses."""
    book = MemoryBook(plan, strict=False, bucket_bytes=bucket_bytes)
    if book.enabled:
        replay_run(plan.cfg, book)
    return book


def replay_run(cfg: Any, book: MemoryBook) -> None:
    """`rollverify train`'s order on do-nothing sides: `start_run`, one step (rollout, train, verify, sync) as the
    loop calls it, a restarted server's restore during the rollout (the transport's `restore`), a checkpoint, an
    export and a restore as `Run` does them."""
    from sglang_ext.pool import ServerAddress

    handoff = make_handoff(cfg, book)
    handoff.measure = False  # nothing runs: nothing to measure
    dry = _Dry()
    servers = [ServerAddress(s.index, f"tcp://replay:{s.index}", None) for s in book.plan.servers] or [
        ServerAddress(i, e, None) for i, e in enumerate(cfg.servers.endpoints)]

    def start_servers() -> _Dry:
        for s in book.plan.servers:
            book.server_started(s.index)
        return dry

    _, _, weights = start_run(cfg, handoff, start_servers, lambda: dry, lambda engine: dry,
                              lambda engine, trainer: make_weights(cfg, engine, trainer, handoff,
                                                                   live=lambda: servers))
    trainer = MeteredTrainer(dry, book)
    book.enter("rollout")
    weights.before_training()
    trainer.train_step()
    trainer.compute_logprobs()
    weights.push(1)
    if hasattr(weights, "restore"):  # a restarted server gets the policy while the others generate
        weights.restore(servers[0], 1)
    for phase, kinds, bucket in RUN_TURNS:
        with handoff.trainer_turn(phase, kinds, bucket=bucket):
            pass
    weights.push(1)  # a restore's push


RUN_TURNS = (("checkpoint", CHECKPOINT_KINDS, False), ("export", EXPORT_KINDS, True),
             ("restore", CHECKPOINT_KINDS, False))


def first_push(handoff: Handoff, weights: Any) -> None:
    """After `start`, servers that released their weights get the trainer's (version 0) and their memory."""
    if handoff.released:
        weights.push(0)
