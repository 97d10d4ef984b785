"""Shared fixtures for the sglang_ext tests: session-wide rollout servers, a fake engine, HF references.

Real servers are expensive (an SGLang start is 10-40 s on two cores), so each kind starts once per session and
is shared: `dense_server` (tiny Qwen3, CURVE keys required) and `moe_server` (tiny Qwen3-MoE, loopback without
keys). A registry keeps them even when several test modules import these fixtures, stops them at session end
(and `--exit-with-parent` stops them if pytest itself dies), and restarts one that a test shut down.
`FakeEngine` stands in for SGLang where the test is about the server's bookkeeping, not the model.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

# A `rollverify train` run of seconds on the tiny model (config overrides): the end-to-end tests and the Ray test
# extend it with what they are about.
SMALL_RUN = [
    "rollout.batch_groups=2",
    "rollout.n=2",
    "rollout.max_new_tokens=48",
    "rollout.max_live=8",
    "log.plots=false",
    "log.tensorboard=false",
    "trainer.lr=1e-4",
]

# ---------------------------------------------------------------------------------------------- real servers


@dataclass
class Served:
    kind: str
    model: Path
    proc: Any  # sglang_ext.launch.ServerProcess
    curve: Any = None  # sglang_ext.client.CurveKeys for clients, when the server requires CURVE
    keys_dir: Path | None = None

    @property
    def endpoint(self) -> str:
        return self.proc.endpoint

    def client(self, **kwargs) -> Mirror:
        return Mirror(self.endpoint, curve=self.curve, **kwargs)


@dataclass
class Tracked:
    """A test's copy of one response: its prompt and every delta received, in order."""

    rid: str
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out) -> None:
        assert out.offset == len(self.token_ids), f"{self.rid}: delta at {out.offset}, held {len(self.token_ids)}"
        self.token_ids = np.concatenate([self.token_ids, out.token_ids])
        self.logprobs = np.concatenate([self.logprobs, out.logprobs])
        self.versions = np.concatenate([self.versions, out.versions])
        if out.routed_experts is not None:
            old = self.routed_experts
            self.routed_experts = out.routed_experts if old is None else np.concatenate([old, out.routed_experts])
        if out.prompt_routed_experts is not None:
            self.prompt_routed_experts = out.prompt_routed_experts
        if out.prefix_routed_experts is not None:  # the engine re-prefilled the kept prefix
            self.routed_experts = np.concatenate([out.prefix_routed_experts, self.routed_experts[out.offset :]])
        self.finish_reason = out.finish_reason

    def truncate(self, keep: int) -> None:
        if keep < len(self.token_ids):
            self.finish_reason = None
        self.token_ids, self.logprobs, self.versions = self.token_ids[:keep], self.logprobs[:keep], self.versions[:keep]
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts[:keep]


class Mirror:
    """A test's controller over one server's connection: each response assembled from pause replies and finish
    events (offsets checked), as the loop's buffer assembles them through the rollout engine. Events are polled
    when the test waits for a finish and at the pause barrier."""

    def __init__(self, endpoint: str, curve: Any = None, poll_wait_s: float = 0.2) -> None:
        self.endpoint, self.curve, self.poll_wait_s = endpoint, curve, poll_wait_s
        self.responses: dict[str, Tracked] = {}
        self.finished_queue: list = []
        self.last_seq = 0

    async def __aenter__(self) -> Mirror:
        from sglang_ext.client import ServerConnection

        self.conn = await ServerConnection(self.endpoint, curve=self.curve, timeout_s=120).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.conn.close()

    async def submit(self, reqs, sampling=None) -> None:
        await self.conn.submit(reqs, sampling)
        for q in reqs:  # held from the submitted prefix on (log-prob NaN and version -1 where not given)
            n = len(q.prefix_ids)
            lp = np.full(n, np.nan, np.float32) if q.prefix_logprobs is None else np.asarray(q.prefix_logprobs)
            ver = np.full(n, -1, np.int32) if q.prefix_versions is None else np.asarray(q.prefix_versions)
            self.responses[q.rid] = Tracked(q.rid, np.asarray(q.prompt_ids, np.int32),
                                            np.asarray(q.prefix_ids, np.int32), lp, ver)

    async def _poll(self, wait_s: float) -> None:
        batch, server_seq = await self.conn.events(self.last_seq, wait_s)
        for out in batch.outputs():
            if out.rid in self.responses:
                self.responses[out.rid].apply(out)
                self.finished_queue.append(out)
        if len(batch):
            self.last_seq = int(batch.seqs[-1])
        self.last_seq = max(self.last_seq, server_seq)

    async def pause(self) -> dict:
        batch, body = await self.conn.pause()
        deltas = {}
        for out in batch.outputs():
            self.responses[out.rid].apply(out)
            deltas[out.rid] = out
        while self.last_seq < body["event_seq"]:  # every finish before the pause is with us once it returns
            await self._poll(0.0)
        return deltas

    async def next_finished(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self.finished_queue:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no response finished within {timeout_s} s")
            await self._poll(self.poll_wait_s)
        return self.finished_queue.pop(0)

    async def truncate(self, keep: dict[str, int]) -> None:
        await self.conn.truncate(keep)
        for rid, k in keep.items():
            self.responses[rid].truncate(k)

    async def resume(self) -> None:
        await self.conn.resume()

    async def update_weights(self, buckets, version: int) -> None:
        buckets = list(buckets)
        for i, b in enumerate(buckets):
            await self.conn.update_weights(b, version, bucket=i, commit=i == len(buckets) - 1)

    async def update_weights_from_disk(self, path, version: int) -> None:
        await self.conn.update_weights_from_disk(path, version)

    async def health(self) -> dict:
        return await self.conn.health()

    async def shutdown(self) -> dict:
        return await self.conn.shutdown()


class _Registry:
    def __init__(self) -> None:
        self.servers: dict[str, Served] = {}
        self.lock = threading.Lock()
        atexit.register(self.stop_all)

    def get(self, kind: str, tmp_root: Path) -> Served:
        with self.lock:
            s = self.servers.get(kind)
            if s is not None and s.proc.proc.poll() is None:
                return s
            s = self._start(kind, tmp_root)
            self.servers[kind] = s
            return s

    def _start(self, kind: str, tmp_root: Path) -> Served:
        from sglang_ext.launch import launch_server

        model = ensure_tiny_model(TinyModelSpec(moe=(kind == "moe")))
        args: list[str] = []
        curve = keys_dir = None
        if kind == "dense":
            curve, keys_dir, server_secret = make_curve_keys(tmp_root / "curve")
            args += [
                "--curve-secret-key",
                str(server_secret),
                "--curve-authorized-keys",
                str(keys_dir / "authorized"),
            ]
        proc = launch_server(
            model,
            args=args,
            engine_args={"max_total_tokens": 32768, "max_running_requests": 256},
            log_path=tmp_root / f"server-{kind}.log",
        )
        return Served(kind, model, proc, curve, keys_dir)

    def forget(self, kind: str) -> None:
        with self.lock:
            self.servers.pop(kind, None)

    def stop_all(self) -> None:
        with self.lock:
            for s in self.servers.values():
                with contextlib.suppress(Exception):
                    s.proc.stop()
            self.servers.clear()


REGISTRY = _Registry()


def make_curve_keys(root: Path):
    """Server and client certificates; the client's public key is the only authorized one."""
    from zmq.auth import create_certificates

    from sglang_ext.client import CurveKeys

    (root / "authorized").mkdir(parents=True, exist_ok=True)
    (root / "private").mkdir(parents=True, exist_ok=True)
    server_pub, server_secret = create_certificates(str(root / "private"), "server")
    client_pub, client_secret = create_certificates(str(root / "private"), "client")
    Path(client_pub).rename(root / "authorized" / Path(client_pub).name)
    return CurveKeys.from_files(server_pub, client_secret), root, Path(server_secret)


@functools.lru_cache(maxsize=1)
def _logs_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="rollverify-test-servers-"))


def _root(_tmp_path_factory=None) -> Path:
    """Keys and server logs; outside pytest's rotating basetemp so a failed run's logs survive."""
    return _logs_root()


# Function-scoped on purpose: the registry keeps one server of each kind for the session and starts a new one
# when a test has stopped it (test_shutdown_leaves_no_child_process); a session-scoped fixture would keep
# handing later modules the stopped one.
@pytest.fixture
def dense_server(tmp_path_factory) -> Served:
    """Tiny dense Qwen3 behind a control channel that requires CURVE keys (`served.curve`)."""
    return REGISTRY.get("dense", _root(tmp_path_factory))


@pytest.fixture
def moe_server(tmp_path_factory) -> Served:
    """Tiny Qwen3-MoE (routed experts on) on loopback without keys."""
    return REGISTRY.get("moe", _root(tmp_path_factory))


async def reset_server(served: Served) -> None:
    """Back to a clean state for the next test: not paused, no responses, base weights (version 0)."""
    from sglang_ext.client import ServerConnection

    conn = await ServerConnection(served.endpoint, curve=served.curve, timeout_s=60).start()
    try:
        info = await conn.health()
        if info["paused"]:
            await conn.resume()
        await conn.drop(all=True)
        if info["version"] != 0:
            await conn.pause()
            await conn.update_weights_from_disk(served.model, 0)
            await conn.resume()
    finally:
        await conn.close()


def run(coro, timeout_s: float = 300.0):
    """Run a test coroutine with an overall time limit."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# ---------------------------------------------------------------------------------------------- HF reference


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_forward(path: str | Path, prompt: np.ndarray, tokens: np.ndarray, temperature: float = 1.0):
    """float32 HF forward of prompt + tokens[:-1]: (log-probs of each generated token under
    log_softmax(logits / T) (T=0 means 1), router top-k [positions, layers, top_k] or None)."""
    import torch

    model = hf_model(str(path))
    ids = np.concatenate([prompt, tokens[:-1]]).astype(np.int64)
    with torch.no_grad():
        out = model(
            torch.from_numpy(ids)[None],
            output_router_logits=getattr(model.config, "num_experts", None) is not None,
        )
    logits = out.logits[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    p = len(prompt)
    gen = lp[p - 1 :].gather(1, torch.from_numpy(tokens.astype(np.int64))[:, None])[:, 0].numpy()
    routes = None
    if getattr(out, "router_logits", None):
        k = model.config.num_experts_per_tok
        routes = torch.stack([torch.topk(r, k, dim=-1).indices for r in out.router_logits], dim=1).numpy()
    return gen.astype(np.float32), routes


def same_routes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per position and layer: the same set of experts (order within top-k is not meaningful)."""
    return (np.sort(a.astype(np.int64), axis=-1) == np.sort(b.astype(np.int64), axis=-1)).all(axis=-1)


# ---------------------------------------------------------------------------------------------- fake engine


class FakeEngine:
    """Deterministic stand-in for EngineHandle: one token per `step_s`, log-probs and routes derived from
    (weights salt, position, previous token), so truncate-then-resume reproduces continuous generation."""

    def __init__(self, vocab: int = 128, moe: bool = True, step_s: float = 0.002, eos: int = 1):
        from sglang_ext.engine import ModelInfo

        weights = {
            "model.embed_tokens.weight": ((vocab, 8), "float32"),
            "lm_head.weight": ((vocab, 8), "float32"),
        }
        self.info = ModelInfo(
            path=Path("/fake"),
            config={"architectures": ["FakeForCausalLM"], "model_type": "fake"},
            weights=weights,
            vocab_size=vocab,
            num_layers=2,
            num_experts=8 if moe else None,
            top_k=2 if moe else None,
            context_len=4096,
            eos_token_ids=[eos],
        )
        self.routes = moe
        self.context_len = 4096
        self.step_s = step_s
        self.eos = eos
        self.salt = 0
        self._aborted: set[str] = set()
        self._live: set[str] = set()
        self._abort_all_at = 0.0
        self.updates: list[int] = []

    def token(self, prev: int, pos: int) -> int:
        t = (prev * 31 + pos * 7 + self.salt * 13) % (self.info.vocab_size - 4) + 4
        return t

    def logprob(self, tok: int, pos: int) -> float:
        return -((tok + pos + self.salt) % 11) / 10.0 - 0.01

    def route(self, pos: int, prev: int) -> np.ndarray:
        base = np.array(
            [
                [(pos + prev + layer + self.salt) % 8, (pos + 3 * layer + 1 + self.salt) % 8]
                for layer in range(2)
            ]
        )
        base[:, 1] = np.where(base[:, 1] == base[:, 0], (base[:, 0] + 1) % 8, base[:, 1])
        return base.astype(np.int32)

    async def generate(self, rid, input_ids, sampling, routes_start):
        from sglang_ext.engine import GenResult

        self._live.add(rid)
        start = asyncio.get_running_loop().time()
        ids = list(input_ids)
        out: list[int] = []
        lps: list[float] = []
        finish = "length"
        matched = None
        try:
            while len(out) < sampling["max_new_tokens"]:
                await asyncio.sleep(self.step_s)
                if rid in self._aborted or self._abort_all_at > start:
                    finish = "abort"
                    break
                pos = len(ids)
                tok = self.token(ids[-1], pos)
                ids.append(tok)
                out.append(tok)
                lps.append(self.logprob(tok, pos))
                if not sampling.get("ignore_eos") and tok == self.eos:
                    finish, matched = "stop", tok
                    break
        finally:
            self._live.discard(rid)
            self._aborted.discard(rid)
        routes = None
        if routes_start is not None:
            seq = ids
            routes = (
                np.stack([self.route(p, seq[p]) for p in range(routes_start, len(seq) - 1)])
                if len(seq) - 1 > routes_start
                else np.zeros((0, 2, 2), np.int32)
            )
        return GenResult(np.array(out, np.int32), np.array(lps, np.float32), routes, finish, matched)

    def abort_all(self) -> None:
        self._abort_all_at = asyncio.get_event_loop().time()

    def abort(self, rid: str) -> None:
        self._aborted.add(rid)

    async def update_tensors(self, buckets) -> None:
        self.salt += 1
        self.updates.append(sum(len(b) for b in buckets))

    async def update_from_disk(self, path: str) -> None:
        self.salt += 1

    async def flush(self) -> None:
        return None

    async def loads(self):
        return []

    def children_alive(self) -> bool:
        return True

    def inflight(self) -> int:
        return len(self._live)


class FakeServer:
    """A ControlServer on a FakeEngine, served from a background thread with its own event loop."""

    def __init__(self, engine: FakeEngine | None = None, **cfg: Any):
        from sglang_ext.server import ControlServer, ServeConfig

        self.engine = engine or FakeEngine()
        self.loop = asyncio.new_event_loop()
        self.cfg = ServeConfig(model="/fake", **cfg)
        self.server: ControlServer | None = None
        self.endpoint = ""
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = ControlServer(self.cfg, self.engine)
            self.endpoint = self.server.bind()
            ready.set()
            try:
                self.loop.run_until_complete(self.server.run())
            except RuntimeError:  # crash() stopped the loop: end what was left (its socket is already closed)
                tasks = asyncio.all_tasks(self.loop)
                for t in tasks:
                    t.cancel()
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.request_stop)
            self.thread.join(timeout_s)

    def alive(self) -> bool:
        """Whether it still serves: with `stop` and `endpoint`, the process handle the rollout engine watches."""
        return self.thread.is_alive()

    def crash(self) -> None:
        """Die like a killed process: no more replies or events, nothing shut down gracefully."""

        def die() -> None:
            self.server.channel.sock.close(linger=0)
            self.loop.stop()

        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(die)
            self.thread.join(10)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
