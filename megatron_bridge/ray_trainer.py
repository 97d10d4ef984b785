"""`RayRanks`: the trainer ranks as Ray actors (`cluster.launcher: ray`), a `RankGroup` for `TrainerProxy`.

Each rank is a `TrainerRank` actor; the application places them (on the bundle of each rank's plan node,
rollverify.app.ray_placement) and hands the handles over. Rank 0 reports its node's address and a port it bound
there; every rank then sets up torch.distributed from them (gloo on CPU, NCCL on GPU, `LOCAL_RANK` = the GPU the
actor was given) and builds its `MegatronTrainer` through the same rank-side code as the local launcher
(megatron_bridge.spawned.start_rank / run_call). The calls travel as actor calls instead of pipe messages, so the
loop drives the same `TrainerProxy` methods.

Weight buckets that rank 0 streams (sync_weights, the HF export) reach the driver's sink through a bounded queue
in the rank-0 actor, drained by the driver while the call runs; they travel as CPU tensors in Ray's object
store. Any rank's exception is raised in the driver naming the rank and its node; a rank whose actor dies, or
that is silent past `timeout_s`, fails the call instead of hanging it: `RankFailure`, as the local launcher's.
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Any

import torch

from megatron_bridge.config import TrainerConfig
from megatron_bridge.proxy import STREAMS, RankFailure
from megatron_bridge.spawned import RankSetup, run_call, start_rank

DONE = "done"


class _QueueSink:
    """Rank 0's weight sink inside its actor: begin/bucket/end events for the driver, at most `depth` waiting."""

    def __init__(self, events: queue.Queue) -> None:
        self.events = events

    def begin(self, version: int) -> None:
        self.events.put(("begin", version))

    def push(self, bucket) -> None:
        self.events.put(("bucket", [(n, t.detach().to("cpu", copy=True)) for n, t in bucket]))

    def end(self, version: int) -> None:
        self.events.put(("end", version))


class TrainerRank:
    """One trainer rank (a Ray actor with two threads: the call, and the driver draining rank 0's buckets)."""

    def __init__(self, rank: int, world_size: int, local_rank: int | None, threads: int) -> None:
        self.rank, self.world_size, self.local_rank, self.threads = rank, world_size, local_rank, threads
        self.trainer = None
        self.events: queue.Queue = queue.Queue(maxsize=2)
        self.received: dict[str, int] = {}  # method -> bytes of batch data its last call received

    def received_bytes(self) -> dict[str, int]:
        """Bytes of sequence and array data each method's last call brought to this rank (`payload_bytes`)."""
        return dict(self.received)

    def address(self) -> tuple[str, int, str]:
        """This node's address, a free port bound on it (the rendezvous when this is rank 0), and the node id."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return ip, port, ray.get_runtime_context().get_node_id()

    def setup(self, master: tuple[str, int], model_path: str, cfg: TrainerConfig, dtype: str, seed: int,
              setup: RankSetup | None = None) -> None:
        self._device()
        self.trainer = start_rank(self.rank, self.world_size, master, model_path, cfg, dtype, seed, self.threads,
                                  self.local_rank, setup)

    def call(self, method: str, payload: tuple[tuple, dict], stream: bool) -> Any:
        """`payload` is `(args, kwargs)` (Ray resolved it from the object store); an argument that is itself an
        ObjectRef (data every rank needs, put once) is fetched here."""
        import ray

        self._device()  # a threaded actor runs calls on pool threads; the CUDA device is per thread
        args, kwargs = payload
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        self.received[method] = payload_bytes(args, kwargs)
        try:
            return run_call(self.trainer, self.rank, method, args, kwargs, _QueueSink(self.events) if stream else None)
        finally:
            if stream and self.rank == 0:
                self.events.put((DONE, None))

    def next_event(self, timeout_s: float) -> tuple[str, Any] | None:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None

    def _device(self) -> None:
        if self.local_rank is not None and torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)


def payload_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the batch data in a call's arguments: sequences' arrays (`batch.sequence_bytes`) and arrays."""
    import numpy as np

    from megatron_bridge.batch import BatchShare, TrainSequence, sequence_bytes

    total = 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, BatchShare):
            total += a.nbytes()
        elif isinstance(a, np.ndarray):
            total += a.nbytes
        elif isinstance(a, (list, tuple)):
            total += sum(sequence_bytes(s) for s in a if isinstance(s, TrainSequence))
    return total


def _put_once(per_rank: list[tuple[tuple, dict]]) -> list[Any]:
    """The object ref of each rank's payload: one `ray.put` per distinct payload object, and arguments shared by
    several distinct payloads (the same object) put once and passed as refs inside them."""
    import ray

    distinct = list({id(p): p for p in per_rank}.values())
    seen: dict[int, int] = {}
    for args, _ in distinct:
        for a in args:
            if not isinstance(a, (int, float, str, bool, type(None))):
                seen[id(a)] = seen.get(id(a), 0) + 1
    shared = {i: None for i, n in seen.items() if n > 1}
    refs: dict[int, Any] = {}
    for p in distinct:
        args, kwargs = p
        out = []
        for a in args:
            if id(a) in shared:
                if shared[id(a)] is None:
                    shared[id(a)] = ray.put(a)
                a = shared[id(a)]
            out.append(a)
        refs[id(p)] = ray.put((tuple(out), kwargs))
    return [refs[id(p)] for p in per_rank]


class RayRanks:
    """The trainer's ranks over `TrainerRank` actors already placed (`actors[r]` is rank r, `where[r]` names its
    node for messages): `__init__` forms their process group and builds every rank's trainer."""

    def __init__(self, actors: list[Any], where: list[str], model_path: str, cfg: TrainerConfig, *,
                 dtype: str = "auto", seed: int = 1234, timeout_s: float | None = None,
                 setup: RankSetup | None = None) -> None:
        self.world_size = len(actors)
        self.timeout_s = cfg.call_timeout_s if timeout_s is None else timeout_s
        self._lock = threading.Lock()
        self._actors, self._where = list(actors), list(where)
        try:
            found = self._gather([a.address.remote() for a in self._actors], what="address")
            self.nodes = [node_id for _, _, node_id in found]  # the Ray node of each rank
            ip, port, _ = found[0]
            self._gather([a.setup.remote((ip, port), str(model_path), cfg, dtype, seed, setup) for a in self._actors],
                         what="setup")
        except BaseException:
            self.close(force=True)
            raise

    def _name(self, rank: int) -> str:
        return f"trainer rank {rank} ({self._where[rank]})"

    def _gather(self, refs: list, *, what: str, ranks: list[int] | None = None) -> list[Any]:
        """Every rank's reply; the first failure (exception, dead actor, silence past timeout_s) is raised at
        once, naming the rank and its node."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        ranks = list(range(len(refs))) if ranks is None else ranks
        index = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not ready:
                late = ", ".join(self._name(ranks[index[r]]) for r in pending)
                first = ranks[index[pending[0]]]
                raise RankFailure(first, what, "silent",
                                  f"no reply within {self.timeout_s:.0f} s from {late} (trainer.call_timeout_s)",
                                  self._where[first])
            i = index[ready[0]]
            try:
                out[i] = ray.get(ready[0], timeout=0)
            except RayActorError as e:
                raise RankFailure(ranks[i], what, "died", str(e), self._where[ranks[i]]) from None
            except RayTaskError as e:
                raise RankFailure(ranks[i], what, "error", str(e), self._where[ranks[i]]) from None
            except GetTimeoutError:  # ready but not yet fetchable: look again
                pending.append(ready[0])
        return out

    def call(self, method: str, args: tuple, kwargs: dict, sink=None) -> Any:
        return self.call_each(method, [(args, kwargs)] * self.world_size, sink)

    def call_each(self, method: str, per_rank: list[tuple[tuple, dict]], sink=None) -> Any:
        """Rank r's call gets `per_rank[r]`. Each distinct payload enters the object store once (ranks given the
        same object share it), and so does an argument that several distinct payloads hold (`_put_once`)."""
        stream = method in STREAMS
        with self._lock:
            refs_of = _put_once(per_rank)
            refs = [a.call.remote(method, refs_of[r], stream) for r, a in enumerate(self._actors)]
            if stream:
                self._drain(refs, sink)
            return self._gather(refs, what=method)[0]

    def _drain(self, refs: list, sink) -> None:
        """Feed rank 0's weight events to `sink` until its call ends (or any rank's call fails)."""
        import ray
        from ray.exceptions import RayActorError

        silent = 0.0
        while True:
            try:
                event = ray.get(self._actors[0].next_event.remote(1.0))
            except RayActorError as e:
                raise RankFailure(0, "sync_weights", "died", str(e), self._where[0]) from None
            if event is None:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                if done:
                    self._gather(done, what="sync_weights", ranks=[refs.index(d) for d in done])
                silent += 1.0
                if silent > self.timeout_s:
                    raise RankFailure(0, "sync_weights", "silent",
                                      f"sent no weights for {self.timeout_s:.0f} s (trainer.call_timeout_s)", self._where[0])
                continue
            silent = 0.0
            kind, payload = event
            if kind == DONE:
                return
            if sink is None:
                continue
            if kind == "begin":
                sink.begin(payload)
            elif kind == "bucket":
                sink.push(payload)
            elif kind == "end":
                sink.end(payload)

    def close(self, force: bool = False) -> None:
        import ray

        actors, self._actors = self._actors, []
        if not force and actors:
            try:
                ray.get([a.close.remote() for a in actors], timeout=30)
            except Exception:  # noqa: BLE001 - the actors are killed below anyway
                pass
        for a in actors:
            ray.kill(a)
