"""The SGLang engine the control server drives: model-folder checks, start/stop, and async calls into it.

The server runs SGLang's in-process `Engine` and calls its tokenizer manager's coroutines on the engine's own
event loop (the same loop the control socket runs on). Nothing here changes SGLang: it checks what SGLang would
otherwise fail on obscurely (or fatally: a wrong-shaped weight kills the scheduler, and SGLang then kills the
whole process tree), and it reaps SGLang's children when a start fails, so no process is left behind.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sglang_ext.tensor_payload import serialize_tensors

# how long a flush waits for SGLang to retire the requests the server already let go of
FLUSH_SETTLE_S = 60.0

log = logging.getLogger("sglang_ext.engine")

SAFETENSORS_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class ModelFolderError(ValueError):
    """A model folder SGLang cannot serve; the message names the folder and what is missing or wrong."""


class EngineStartError(RuntimeError):
    """SGLang did not start; every child process it had spawned has been ended."""


@dataclass
class ModelInfo:
    """What the server needs to know about the checkpoint it serves (read once from the folder)."""

    path: Path
    config: dict[str, Any]
    weights: dict[str, tuple[tuple[int, ...], str]]  # Hugging Face name -> (shape, dtype)
    vocab_size: int
    num_layers: int
    num_experts: int | None = None
    top_k: int | None = None
    context_len: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)


def _read_safetensors_header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit in a {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not a valid safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path} is not a valid safetensors file: header is not a JSON object")
    data_len = size - 8 - n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            end = int(meta["data_offsets"][1])
            _ = meta["shape"], meta["dtype"]
        except (KeyError, TypeError, IndexError, ValueError):
            raise ModelFolderError(
                f"{path} is not a valid safetensors file: bad entry for {name!r}"
            ) from None
        if end > data_len:
            raise ModelFolderError(
                f"{path} is truncated: tensor {name!r} ends at byte {end} of a {data_len}-byte data section"
            )
    return header


def inspect_model_folder(path: str | os.PathLike) -> ModelInfo:
    """Check a Hugging Face model folder before SGLang sees it; raise ModelFolderError naming the problem."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFolderError(f"model folder {p} does not exist")
    if not p.is_dir():
        raise ModelFolderError(f"model path {p} is not a folder (expected a Hugging Face model folder)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelFolderError(f"model folder {p} has no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or not config.get("architectures") or not config.get("model_type"):
        raise ModelFolderError(f"{cfg_path} names no model_type and architectures")
    for key in ("vocab_size", "num_hidden_layers", "hidden_size"):
        if not isinstance(config.get(key), int):
            raise ModelFolderError(f"{cfg_path} has no integer {key}")

    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ModelFolderError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({p / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFolderError(
                f"model folder {p} lacks weight shards named by {index.name}: {missing[:5]}"
            )
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        others = [f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {others[:3]}; convert them to safetensors)" if others else ""
        raise ModelFolderError(f"model folder {p} has no weights: no *.safetensors file{hint}")

    weights: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        for name, meta in _read_safetensors_header(f).items():
            if name != "__metadata__":
                weights[name] = (
                    tuple(int(d) for d in meta["shape"]),
                    SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]),
                )

    vocab, hidden, layers = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    emb = weights.get("model.embed_tokens.weight")
    if emb is not None and emb[0] != (vocab, hidden):
        raise ModelFolderError(
            f"model folder {p}: config.json says vocab_size {vocab} x hidden_size {hidden} but "
            f"model.embed_tokens.weight has shape {list(emb[0])}"
        )
    found = {
        int(n.split(".")[2]) for n in weights if n.startswith("model.layers.") and n.split(".")[2].isdigit()
    }
    if found and found != set(range(layers)):
        raise ModelFolderError(
            f"model folder {p}: config.json says num_hidden_layers {layers} but the weights hold layers "
            f"{sorted(found)[:8]}{'...' if len(found) > 8 else ''}"
        )
    _check_attention_shapes(p, config, weights)
    num_experts = config.get("num_experts") or config.get("num_local_experts") or None
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return ModelInfo(
        path=p.resolve(),
        config=config,
        weights=weights,
        vocab_size=vocab,
        num_layers=layers,
        num_experts=int(num_experts) if num_experts else None,
        top_k=int(config["num_experts_per_tok"]) if num_experts else None,
        context_len=config.get("max_position_embeddings"),
        eos_token_ids=eos_ids,
    )


def _check_attention_shapes(p: Path, config: dict[str, Any], weights: dict) -> None:
    """Llama-family attention projections against the config: a mismatch otherwise kills SGLang's scheduler."""
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        return
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    expect = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim}
    for proj, rows in expect.items():
        w = weights.get(f"model.layers.0.self_attn.{proj}.weight")
        if w is not None and w[0] != (rows, hidden):
            raise ModelFolderError(
                f"model folder {p}: config.json (heads {heads}, kv heads {kv}, head_dim {head_dim}, hidden_size "
                f"{hidden}) needs model.layers.0.self_attn.{proj}.weight of shape {[rows, hidden]}, the weights "
                f"have {list(w[0])}"
            )


# ---------------------------------------------------------------------------------------------- engine


class _ChildFailed(Exception):
    pass


def _launch_sigquit(signum, frame):  # pragma: no cover - runs in the signal context
    """SGLang children SIGQUIT their parent when they fail; SGLang's own handler SIGKILLs the whole tree,
    us included, before anyone can say why. Raise instead, so start() reports and reaps."""
    raise _ChildFailed("a SGLang child process failed while starting (its traceback is in the log above)")


def reap_children(timeout: float = 3.0) -> list[int]:
    """End every descendant of this process (they are SGLang's, started by our Engine); return their pids."""
    import psutil

    me = psutil.Process()
    procs = me.children(recursive=True)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [p.pid for p in procs]


def default_engine_kwargs() -> dict[str, Any]:
    """Engine arguments: the CPU set when no GPU is used, else SGLang's defaults; ids in, ids out."""
    from sglang_ext import cpu_compat

    base = cpu_compat.engine_kwargs() if cpu_compat.use_cpu() else {}
    base.setdefault("skip_tokenizer_init", True)
    # Not sleep_on_idle: it stops an idle scheduler spinning a core, but in 0.5.23 on CPU it also stalls work
    # (tools/bench_idle.py at 256 responses: ~5x fewer tokens per second, pauses of 1.4-2.5 s, whole seconds of
    # its idle poll, instead of 0.12 s). The spin is made harmless instead: EngineHandle.set_idle.
    base.setdefault("log_level", "warning")
    return base


@dataclass
class GenResult:
    output_ids: np.ndarray  # int32 [m]
    logprobs: np.ndarray  # float32 [m]
    routes: np.ndarray | None  # int32 [rows, layers, top_k] as SGLang returned them
    finish_type: str  # stop | length | abort | error
    matched_stop: int | None = None
    error: str | None = None
    cached_tokens: int = 0  # input tokens SGLang found in its prefix (radix) cache rather than prefilled


class EngineHandle:
    """An in-process SGLang Engine and the coroutines the server awaits on its loop."""

    def __init__(self, engine: Any, info: ModelInfo, routes: bool):
        self.engine = engine
        self.info = info
        self.routes = routes
        self.tm = engine.tokenizer_manager
        self.loop = engine.loop
        self.tp_size = int(getattr(engine.server_args, "tp_size", 1) or 1)
        self.context_len = int(getattr(self.tm, "context_len", 0) or info.context_len or 0)
        self.transport = EngineTransport(self.tm)  # the weight transports and memory handoff (handlers/transport.py)
        self._closed = False
        self._idle_nice = 0  # niceness of SGLang's children while nothing generates; 0: never changed
        self._base_nice: dict[int, int] = {}
        self._idle: bool | None = None

    @classmethod
    def start(cls, info: ModelInfo, routes: bool, **engine_kwargs: Any) -> EngineHandle:
        """Start SGLang on a checked folder; on failure end its children and raise EngineStartError."""
        from sglang_ext import cpu_compat

        cpu_compat.activate()
        import sglang as sgl

        kwargs = {**default_engine_kwargs(), **engine_kwargs}
        if routes:
            kwargs["enable_return_routed_experts"] = True
        kwargs.setdefault("custom_sigquit_handler", _launch_sigquit)
        t0 = time.monotonic()
        try:
            engine = sgl.Engine(model_path=str(info.path), **kwargs)
        except BaseException as e:
            reaped = reap_children()
            cause = f"{type(e).__name__}: {e}"
            raise EngineStartError(
                f"SGLang could not serve model folder {info.path}: {cause}"
                + (f" (ended {len(reaped)} child processes)" if reaped else "")
            ) from e
        log.info("SGLang engine up in %.1f s (model %s)", time.monotonic() - t0, info.path)
        handle = cls(engine, info, routes)
        return handle

    def enable_idle_nice(self, nice: int) -> bool:
        """Lower SGLang's children to `nice` whenever nothing generates (set_idle), back when work arrives.

        An idle scheduler spins a core in its event loop; at niceness 19 it yields that core to anything else
        (the trainer between rollouts) while still answering at once. Needs the right to restore the priority
        (root or RLIMIT_NICE): probed here, and left off without it, so a child never stays deprioritized."""
        import psutil

        if nice <= 0:
            return False
        try:
            procs = [psutil.Process(p) for p in self.child_pids()]
            base = {p.pid: p.nice() for p in procs}
            for p in procs:
                p.nice(min(base[p.pid] + 1, 19))
                p.nice(base[p.pid])
        except (psutil.Error, OSError) as e:
            log.info("idle niceness off: SGLang's priority could not be lowered and restored (%s)", e)
            return False
        self._idle_nice, self._base_nice = nice, base
        self.set_idle(True)
        return True

    def set_idle(self, idle: bool) -> None:
        """Nothing generates (`idle`) or an engine request is about to start; see enable_idle_nice."""
        import psutil

        if not self._idle_nice or idle == self._idle:
            return
        self._idle = idle
        for pid, base in self._base_nice.items():
            try:
                psutil.Process(pid).nice(self._idle_nice if idle else base)
            except (psutil.Error, OSError) as e:
                log.warning("could not set the niceness of SGLang process %d: %s", pid, e)

    def prepare(self) -> None:
        """Start SGLang's output loop now (it installs signal handlers the server then overrides)."""
        self.tm.auto_create_handle_loop()

    async def freeze_gc(self) -> None:
        """Move everything alive after start-up out of the garbage collector's reach (here and in the
        scheduler): with SGLang, torch and transformers loaded, a full collection walks millions of objects,
        and launching many requests triggers them (measured: seconds-long stalls at 1024 resumes)."""
        await self.tm.freeze_gc()

    def child_pids(self) -> list[int]:
        try:
            return list(self.engine.get_all_child_pids())
        except Exception:
            return []

    def children_alive(self) -> bool:
        import psutil

        pids = self.child_pids()
        return bool(pids) and all(psutil.pid_exists(p) for p in pids)

    def inflight(self) -> int:
        return len(getattr(self.tm, "rid_to_state", {}))

    async def generate(
        self, rid: str, input_ids: list[int], sampling: dict[str, Any], routes_start: int | None
    ) -> GenResult:
        """One request to completion (finish, length, or abort); never raises for request-level failures."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=input_ids,
            sampling_params=sampling,
            return_logprob=True,
            logprob_start_len=-1,
            return_routed_experts=routes_start is not None,
            routed_experts_start_len=routes_start or 0,
            rid=rid,
        )
        gen = self.tm.generate_request(obj, None)
        try:
            out = await gen.__anext__()
        except (
            ValueError,
            RuntimeError,
        ) as e:  # SGLang rejects a request (too long, bad params, aborted with 4xx)
            return GenResult(np.zeros(0, np.int32), np.zeros(0, np.float32), None, "error", error=str(e))
        finally:
            await gen.aclose()
        meta = out["meta_info"]
        ids = np.asarray(out.get("output_ids") or [], dtype=np.int32)
        lps = meta.get("output_token_logprobs") or []
        logprobs = np.fromiter((t[0] for t in lps), dtype=np.float32, count=len(lps))
        if len(logprobs) != len(ids):
            return GenResult(
                ids,
                logprobs,
                None,
                "error",
                error=f"SGLang returned {len(ids)} tokens but {len(logprobs)} log-probs",
            )
        routes = None
        raw = meta.get("routed_experts")
        if routes_start is not None and raw is not None:
            buf = base64.b64decode(raw) if isinstance(raw, str) else np.asarray(raw, dtype=np.int32).tobytes()
            flat = np.frombuffer(buf, dtype=np.int32)
            k = self.info.top_k or 1
            rows = len(input_ids) + len(ids) - 1 - routes_start  # SGLang covers [start, seqlen - 1)
            if rows > 0 and flat.size % (rows * k) == 0:
                routes = flat.reshape(rows, -1, k)
            elif rows <= 0 and flat.size == 0:
                routes = flat.reshape(0, self.info.num_layers, k)
            else:
                log.warning(
                    "request %s: %d route values do not fit %d rows x top_k %d", rid, flat.size, rows, k
                )
        fr = meta.get("finish_reason") or {}
        ftype = fr.get("type", "error") if isinstance(fr, dict) else str(fr)
        matched = fr.get("matched") if isinstance(fr, dict) else None
        err = None
        if ftype == "abort" and isinstance(fr, dict) and fr.get("status_code"):
            ftype, err = "error", str(fr.get("message"))
        return GenResult(ids, logprobs, routes, ftype, matched if isinstance(matched, int) else None, err,
                         int(meta.get("cached_tokens") or 0))

    async def input_logprobs(self, requests: Sequence[PrefillRequest]) -> list[np.ndarray]:
        """Log-probs (float32) of each request's `input_ids[start:]` under the served weights, each at the
        position before it.

        One batched prefill-only request (`max_new_tokens` 0, nothing sampled): SGLang hands a batch of
        pre-tokenized inputs to its scheduler as one message, so they prefill together instead of in the
        batches their one-by-one arrival would make. SGLang's input log-probs are asked from `start - 1` on,
        since its first entry is the shifted-out position and carries no value; they are `log_softmax(logits)`,
        never tempered (SGLang 0.5.23 applies the temperature to output log-probs only). Each request's KV
        enters the prefix (radix) cache when it ends, so a later request for a prefix of its `input_ids`
        prefills only what follows the cached part. Raises RuntimeError when SGLang refuses the batch or
        answers a request with other tokens or another count than asked."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        for r in requests:
            if not 1 <= r.start <= len(r.input_ids):
                raise ValueError(
                    f"request {r.rid}: start {r.start} must be in [1, {len(r.input_ids)}] (the first input token "
                    "has no log-prob)"
                )
        out = [np.zeros(0, np.float32) for _ in requests]
        todo = [i for i, r in enumerate(requests) if r.start < len(r.input_ids)]
        if not todo:
            return out
        obj = GenerateReqInput(
            input_ids=[requests[i].input_ids for i in todo],
            sampling_params=[{"max_new_tokens": 0} for _ in todo],
            return_logprob=True,
            logprob_start_len=[requests[i].start - 1 for i in todo],
            rid=[requests[i].rid for i in todo],
        )
        gen = self.tm.generate_request(obj, None)
        try:
            answers = await gen.__anext__()
        except (ValueError, RuntimeError) as e:
            raise RuntimeError(
                f"SGLang refused the batch of {len(todo)} log-prob requests (the first {requests[todo[0]].rid}): {e}"
            ) from e
        finally:
            await gen.aclose()
        for i, answer in zip(todo, answers, strict=True):
            out[i] = _input_logprobs(requests[i], answer["meta_info"], self.info.vocab_size)
        return out

    def abort_all(self) -> None:
        self.tm.abort_request(abort_all=True)

    def abort(self, rid: str) -> None:
        """Abort one request; may be repeated (SGLang sends an abort per request only once otherwise)."""
        state = self.tm.rid_to_state.get(rid)
        if state is not None:
            state.abort_sent = False
        self.tm.abort_request(rid=rid)

    async def update_tensors(self, buckets: list[list[tuple[str, Any]]]) -> None:
        """Load already-validated tensors (Hugging Face names), one SGLang call per bucket, then flush."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        ok, msg = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise RuntimeError(f"begin_weight_update: {msg}")
        try:
            for named in buckets:
                payload = [serialize_tensors(named) for _ in range(self.tp_size)]
                obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, flush_cache=False)
                ok, msg = await self.tm.update_weights_from_tensor(obj, None)
                if not ok:
                    raise RuntimeError(f"update_weights_from_tensor: {msg}")
        finally:
            ok, msg = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
            if not ok:
                log.warning("end_weight_update: %s", msg)
        await self.flush()

    async def update_from_disk(self, path: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        # the cache is emptied by `flush` after it, which waits for SGLang to retire requests the server let go of
        res = await self.tm.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=path, flush_cache=False),
                                                     None)
        ok, msg = res[0], res[1]
        if not ok:
            raise RuntimeError(f"update_weights_from_disk: {msg}")
        await self.flush()

    async def flush(self) -> None:
        """Empty SGLang's caches. The caller has made the server idle (`Records.require_idle`), but SGLang's
        scheduler retires an aborted or finished request a few iterations after the server stopped waiting on it,
        and refuses the flush while one is left: the flush is retried until that is done, at most
        FLUSH_SETTLE_S (a loaded machine can take seconds per iteration)."""
        import asyncio

        deadline = time.monotonic() + FLUSH_SETTLE_S
        while True:
            res = await self.tm.flush_cache()
            if getattr(res, "success", True):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"flush_cache: {getattr(res, 'message', res)} (still refused after "
                                   f"{FLUSH_SETTLE_S:.0f} s)")
            await asyncio.sleep(0.1)

    async def loads(self) -> list[dict[str, Any]]:
        import msgspec

        snaps = await self.tm.get_loads(include=["core", "queues"])
        return [msgspec.to_builtins(s) for s in snaps]

    def shutdown(self) -> None:
        """Stop SGLang and make sure none of its processes outlives this call."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.shutdown()
        except Exception as e:  # pragma: no cover - best effort, reaped below
            log.warning("engine shutdown: %s", e)
        reap_children()


class EngineTransport:
    """SGLang's side of the GPU weight transports and the colocated memory handoff: the tokenizer manager's
    weight-update group, weight-update session, bucket loads and memory occupation calls. Driven by
    sglang_ext/handlers/transport.py, which checks every step first; each raises RuntimeError when SGLang refuses."""

    def __init__(self, tm: Any):
        self.tm = tm

    async def join_weight_group(
        self, master_addr: str, master_port: int, rank_offset: int, world_size: int, group: str, backend: str
    ) -> None:
        """Join the trainer's weight-update group (SGLang's `init_weights_update_group`): each scheduler TP rank
        becomes rank `rank_offset + tp_rank`; returns once the whole group has formed."""
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        obj = InitWeightsUpdateGroupReqInput(
            master_address=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group,
            backend=backend,
        )
        ok, msg = await self.tm.init_weights_update_group(obj, None)
        if not ok:
            raise RuntimeError(f"init_weights_update_group: {msg}")

    async def begin_weight_update(self) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        ok, msg = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise RuntimeError(f"begin_weight_update: {msg}")

    async def end_weight_update(self) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        ok, msg = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok:
            raise RuntimeError(f"end_weight_update: {msg}")

    async def receive_bucket(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group: str) -> None:
        """Receive one flattened bucket broadcast by the group's rank 0 and load it (inside a weight update)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        obj = UpdateWeightsFromDistributedReqInput(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group, flush_cache=False,
            load_format="flattened_bucket",
        )
        ok, msg = await self.tm.update_weights_from_distributed(obj, None)
        if not ok:
            raise RuntimeError(f"update_weights_from_distributed: {msg}")

    async def load_flattened(self, payloads: list[bytes]) -> None:
        """Load one flattened bucket from serialized payloads, one per TP rank (CUDA IPC handles of the trainer's
        buffer on a GPU; shared memory on CPU), inside a weight update."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format="flattened_bucket", flush_cache=False
        )
        ok, msg = await self.tm.update_weights_from_tensor(obj, None)
        if not ok:
            raise RuntimeError(f"update_weights_from_tensor: {msg}")

    async def release_memory(self, tags: list[str]) -> None:
        """Free the GPU memory of `tags` (weights, kv_cache, cuda_graph); needs nothing running."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        await self.tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None)

    async def resume_memory(self, tags: list[str]) -> None:
        """Take back the memory of `tags` released before (released weights come back undefined: load after)."""
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self.tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None)


@dataclass(frozen=True)
class PrefillRequest:
    """One sequence whose tokens from `start` on get their log-probs (`EngineHandle.input_logprobs`)."""

    rid: str
    input_ids: list[int]
    start: int


def _input_logprobs(req: PrefillRequest, meta: dict, vocab_size: int) -> np.ndarray:
    """The log-probs of `req.input_ids[req.start:]` from SGLang's answer, checked token by token.

    SGLang 0.5.23 reports an input token id >= vocab_size - 1 as 0 (`logprob_result_processor.py` clips what
    would be an image's padded hash); its log-prob is that token's, so such an entry checks against 0."""
    fr = meta.get("finish_reason") or {}
    if isinstance(fr, dict) and fr.get("type") == "abort":
        raise RuntimeError(f"SGLang aborted the log-prob request {req.rid}: {fr.get('message')}")
    entries = (meta.get("input_token_logprobs") or [])[1:]
    want = [t if t < vocab_size - 1 else 0 for t in req.input_ids[req.start :]]
    wrong = next((j for j, (e, t) in enumerate(zip(entries, want, strict=False)) if e[1] != t), None)
    if len(entries) != len(want) or wrong is not None:
        where = "" if wrong is None else (
            f"; entry {wrong} is token {entries[wrong][1]} where {want[wrong]} was asked "
            f"(ids around it: {[e[1] for e in entries[max(0, wrong - 3):wrong + 3]]} against "
            f"{want[max(0, wrong - 3):wrong + 3]})"
        )
        raise RuntimeError(
            f"SGLang returned {len(entries)} input log-probs for request {req.rid}, not those of the {len(want)} "
            f"tokens asked for (input {len(req.input_ids)} tokens from {req.start}){where}"
        )
    return np.fromiter((e[0] for e in entries), dtype=np.float32, count=len(entries))
