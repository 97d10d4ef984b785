"""`rollverify serve`: one SGLang engine behind a ZMQ control channel (see docs/protocol.md).

The server owns the cache of every response it generates. Pause aborts all engine requests and hands the
controller each live response's output since its last report; truncation cuts the cache; resume relaunches
every live response from prompt + kept tokens under the current weights; weight updates are validated in full
before any of them reaches SGLang. Commands run one at a time in arrival order; queries (events, stats, health,
fetch) are answered beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sglang_ext.protocol import (
    BODIES,
    INT32_MAX,
    PROTOCOL_VERSION,
    QUERY_TYPES,
    DropBody,
    ErrorCode,
    EventsBody,
    FetchBody,
    Header,
    Message,
    Output,
    ProtocolError,
    StatsBody,
    SubmitBody,
    TruncateBody,
    UpdateWeightsBody,
    UpdateWeightsFromDiskBody,
    check_buffer_names,
    decode,
    encode,
    encode_outputs,
    error_header,
    parse_body,
    route_dtype,
)
from sglang_ext.store import Record, RouteShape, State, new_record

log = logging.getLogger("sglang_ext.server")

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
STOP_TIMEOUT_S = 120.0


class ConfigError(ValueError):
    """A serve configuration that must not start (e.g. an open port without authentication)."""


@dataclass
class ServeConfig:
    model: str
    control: str = "tcp://127.0.0.1:0"
    curve_secret_key: str | None = None  # zmq certificate file holding the server's secret key
    curve_authorized_keys: str | None = None  # folder of client public-key certificates
    routed_experts: bool | None = None  # None: on for MoE checkpoints
    ready_file: str | None = None
    exit_with_parent: bool = False
    version: int = 0
    idle_nice: int = 19  # niceness of SGLang's processes while nothing generates (0: unchanged)
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key)


def bind_address(endpoint: str) -> str:
    """ZMQ bind address; port 0 becomes '*' (an ephemeral port, reported in the ready file)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


def check_config(cfg: ServeConfig) -> None:
    """Everything `serve` refuses before it starts SGLang: an open endpoint (check_endpoint), a starting weights
    version outside [0, 2**31 - 1] (versions travel as int32 per token), a niceness outside [0, 19]."""
    if not 0 <= cfg.version <= INT32_MAX:
        raise ConfigError(f"--weights-version {cfg.version} is outside [0, {INT32_MAX}]")
    if not 0 <= cfg.idle_nice <= 19:
        raise ConfigError(f"--idle-nice {cfg.idle_nice} is outside [0, 19]")
    check_endpoint(cfg)


def check_endpoint(cfg: ServeConfig) -> None:
    """Refuse anything but loopback (or ipc) unless CURVE keys are configured: the channel can replace weights."""
    ep = cfg.control
    if cfg.curve:
        if not cfg.curve_authorized_keys:
            raise ConfigError(
                "--curve-secret-key needs --curve-authorized-keys (the folder of client public keys)"
            )
        for p in (cfg.curve_secret_key, cfg.curve_authorized_keys):
            if not Path(p).exists():
                raise ConfigError(f"CURVE key path {p} does not exist")
    scheme, _, rest = ep.partition("://")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp" or not rest:
        raise ConfigError(f"control endpoint {ep!r} must be tcp://HOST:PORT or ipc://PATH")
    host = rest.rsplit(":", 1)[0].strip("[]")
    loopback = host == "localhost"
    if not loopback:
        with contextlib.suppress(ValueError):
            loopback = ipaddress.ip_address(host).is_loopback
    if not loopback and not cfg.curve:
        raise ConfigError(
            f"refusing to bind the control channel to {ep}: it is not a loopback address and no CURVE keys were "
            "given. Anyone who reaches it could replace the model's weights. Bind to tcp://127.0.0.1:PORT, or "
            "pass --curve-secret-key SERVER.key_secret and --curve-authorized-keys CLIENT_KEYS_DIR."
        )


@dataclass
class _Staged:
    version: int
    next_bucket: int = 0
    buckets: list[list[tuple[str, Any]]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(len(b) for b in self.buckets)


class ControlServer:
    """The control channel around one EngineHandle (or any object with the same coroutines, for tests)."""

    def __init__(self, cfg: ServeConfig, engine: Any):
        self.cfg = cfg
        self.engine = engine
        self.info = engine.info
        self.version = cfg.version
        self.paused = False
        self.records: dict[str, Record] = {}
        self.route_shape: RouteShape | None = None
        if engine.routes:
            self.route_shape = RouteShape(
                self.info.num_layers, int(self.info.top_k), route_dtype(int(self.info.num_experts))
            )
        self._events: deque[Output] = deque()
        self._seq = 0
        self._waiters: set[asyncio.Future] = set()
        self._commands: asyncio.Queue = asyncio.Queue()
        self._staged: _Staged | None = None
        self._stop = asyncio.Event()
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()
        self.tokens_generated = 0
        self._generating = 0  # engine requests in flight (their _generate tasks)
        self._engine_busy = 0  # engine calls in flight (generation, weights, flush, loads): SGLang at full priority
        self._set_idle = getattr(engine, "set_idle", None)
        self.started = time.time()
        self.endpoint: str | None = None
        self.sock = None
        self._auth = None

    # ------------------------------------------------------------------------------------- lifecycle

    def bind(self) -> str:
        """Create and bind the socket (before the loop runs, so a taken port fails fast)."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.cfg.curve:
            from zmq.auth import load_certificate
            from zmq.auth.thread import ThreadAuthenticator

            public, secret = load_certificate(self.cfg.curve_secret_key)
            if secret is None:
                raise ConfigError(f"{self.cfg.curve_secret_key} holds no secret key")
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.cfg.curve_authorized_keys))
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        sock.bind(bind_address(self.cfg.control))
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.sock = sock
        return self.endpoint

    def _write_ready(self) -> None:
        if not self.cfg.ready_file:
            return
        info = {
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "version": self.version,
            **self._model_info(),
        }
        path = Path(self.cfg.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)

    def _model_info(self) -> dict[str, Any]:
        rs = self.route_shape
        archs = self.info.config.get("architectures") or [None]
        return {
            "model": str(self.info.path),
            "architecture": archs[0],
            "model_type": self.info.config.get("model_type"),
            "context_len": int(getattr(self.engine, "context_len", 0) or self.info.context_len or 0),
            "vocab_size": self.info.vocab_size,
            "routed_experts": rs is not None,
            "layers": rs.layers if rs else None,
            "top_k": rs.top_k if rs else None,
            "num_experts": self.info.num_experts,
            "route_dtype": rs.dtype.name if rs else None,
        }

    def request_stop(self, reason: str = "signal") -> None:
        if not self._stopping:
            log.info("stopping (%s)", reason)
        self._stopping = True
        self._stop.set()

    async def run(self) -> None:
        """Serve until shutdown (a command, SIGTERM/SIGINT, or the parent's death with exit_with_parent)."""
        if self.sock is None:
            self.bind()
        loop = asyncio.get_running_loop()
        prepare = getattr(self.engine, "prepare", None)
        if prepare is not None:
            prepare()  # SGLang installs its own SIGTERM handler here; ours must come after it
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.request_stop, sig.name)
        freeze = getattr(self.engine, "freeze_gc", None)
        if freeze is not None:
            await freeze()
        self._spawn(self._command_worker())
        if self.cfg.exit_with_parent:
            self._spawn(self._watch_parent(os.getppid()))
        self._write_ready()
        log.info("control channel on %s (model %s)", self.endpoint, self.info.path)
        recv = None
        try:
            while not self._stop.is_set():
                recv = asyncio.ensure_future(self.sock.recv_multipart(copy=False))
                stop = asyncio.ensure_future(self._stop.wait())
                done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if recv in done:
                    frames = recv.result()
                    recv = None
                    self._on_frames(frames)
        finally:
            if recv is not None:
                recv.cancel()
            await self._teardown()

    async def _teardown(self) -> None:
        running = [r for r in self.records.values() if r.state is State.RUNNING]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._stop_running(running), 10.0)
        await asyncio.sleep(0.05)  # let the shutdown reply leave
        for t in list(self._tasks):
            t.cancel()
        self.sock.close(linger=500)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)
        log.info("control channel closed")

    async def _watch_parent(self, parent: int) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(1.0)
            if os.getppid() != parent:
                self.request_stop(f"parent process {parent} is gone")

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ------------------------------------------------------------------------------------- dispatch

    def _on_frames(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:], request=True)
        except ProtocolError as e:
            self._send(identity, error_header(e.req_id, e.req_type, e))
            return
        except Exception as e:  # a parser fault must cost one error reply, never the server
            log.exception("decoding a request failed")
            err = ProtocolError(ErrorCode.MALFORMED, f"unreadable request: {type(e).__name__}")
            self._send(identity, error_header(None, None, err))
            return
        typ = msg.header.type
        if typ not in BODIES:
            shown = typ if typ is None or len(typ) <= 64 else typ[:61] + "..."
            err = ProtocolError(
                ErrorCode.UNKNOWN_TYPE, f"unknown message type {shown!r}; known: {sorted(BODIES)}"
            )
            self._send(identity, error_header(msg.header.id, shown, err))
            return
        received = (time.perf_counter(), time.time())
        if typ in QUERY_TYPES:
            self._spawn(self._execute(identity, msg, received))
        else:
            self._commands.put_nowait((identity, msg, received))

    async def _command_worker(self) -> None:
        while True:
            identity, msg, received = await self._commands.get()
            try:
                await self._execute(identity, msg, received)
            except Exception:  # _execute answers every failure itself; this worker must outlive anything
                log.exception("command %s escaped its error handling", msg.header.type)

    async def _execute(self, identity: bytes, msg: Message, received: tuple[float, float]) -> None:
        typ = msg.header.type
        try:
            if self._stopping and typ != "health":
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            body = parse_body(BODIES[typ], msg.body, typ)
            check_buffer_names(typ, msg)
            reply_body, arrays, raw = await getattr(self, f"_op_{typ}")(body, msg)
            reply_body["handled_s"] = time.perf_counter() - received[0]  # arrival to reply, queueing included
            # wall-clock stamps: with the client's own, they split a call's latency into its two hops
            reply_body["received_at"], reply_body["sent_at"] = received[1], time.time()
            header = Header(proto=PROTOCOL_VERSION, id=msg.header.id, type=typ, ok=True, body=reply_body)
            self._send(identity, header, arrays, raw)
        except ProtocolError as e:
            self._send(identity, error_header(msg.header.id, typ, e))
        except Exception as e:
            log.exception("%s failed", typ)
            err = ProtocolError(
                ErrorCode.ENGINE_ERROR, f"{typ} failed in the server: {type(e).__name__}: {e}"
            )
            self._send(identity, error_header(msg.header.id, typ, err))

    def _send(
        self, identity: bytes, header: Header, arrays: dict | None = None, raw: list | None = None
    ) -> None:
        try:
            frames = encode(header, arrays, raw)
        except Exception as e:  # answered with an error that can be encoded: every request gets one reply
            log.exception("could not encode a %s reply", header.type)
            err = ProtocolError(
                ErrorCode.ENGINE_ERROR,
                f"the reply could not be encoded ({type(e).__name__}); if the request changed state, "
                "stats and fetch show it",
            )
            try:
                frames = encode(error_header(header.id, header.type, err))
            except Exception:
                frames = encode(error_header(None, None, err))
        try:
            self.sock.send_multipart([identity, *frames], copy=False)
        except Exception as e:  # a vanished peer must not stop the server
            log.warning("could not send a %s reply: %s", header.type, e)

    # ------------------------------------------------------------------------------------- engine side

    def _launch(self, rec: Record) -> None:
        if rec.remaining <= 0:
            self._finish(rec, "length")
            return
        rec.launch_len = n = len(rec)
        rec.launch_version = self.version
        plen = len(rec.prompt)
        routes_start = None
        if self.route_shape is not None:
            # routes of the positions that will sample new tokens; from 0 when the prompt's own are still unknown
            routes_start = 0 if (rec.prompt_routes is None and n == 0) else plen + n - 1
        sampling = dict(rec.sampling_args)
        sampling["max_new_tokens"] = rec.remaining
        input_ids = np.concatenate([rec.prompt, rec.tokens]).tolist()
        self._busy(+1)
        self._generating += 1
        rec.task = self._spawn(self._generate(rec, rec.engine_rid(), input_ids, sampling, routes_start))
        rec.state = State.RUNNING

    async def _generate(
        self, rec: Record, erid: str, input_ids: list[int], sampling: dict, routes_start
    ) -> None:
        try:
            await self._generate_one(rec, erid, input_ids, sampling, routes_start)
        finally:
            self._generating -= 1
            self._busy(-1)

    def _busy(self, delta: int) -> None:
        """Count an engine call in or out; SGLang runs at its idle niceness only while none is in flight."""
        before, self._engine_busy = self._engine_busy, self._engine_busy + delta
        if self._set_idle is not None and (before == 0) != (self._engine_busy == 0):
            self._set_idle(self._engine_busy == 0)

    @contextlib.asynccontextmanager
    async def _engine_call(self):
        """An engine call other than generation (weights, flush, loads) runs with SGLang at full priority."""
        self._busy(+1)
        try:
            yield
        finally:
            self._busy(-1)

    async def _generate_one(
        self, rec: Record, erid: str, input_ids: list[int], sampling: dict, routes_start
    ) -> None:
        try:
            res = await self.engine.generate(erid, input_ids, sampling, routes_start)
        except Exception as e:
            log.exception("engine request %s failed", erid)
            from sglang_ext.engine import GenResult

            res = GenResult(np.zeros(0, np.int32), np.zeros(0, np.float32), None, "error", error=str(e))
        if self.records.get(rec.rid) is not rec or rec.state is not State.RUNNING:
            return  # dropped meanwhile
        rec.task = None
        try:
            self._absorb(rec, res, routes_start)
        except Exception as e:  # never leave a response running with no engine request behind it
            log.exception("response %s: recording the engine's output failed", rec.rid)
            if rec.state is State.RUNNING:
                self._finish(rec, "error", f"recording the engine's output failed: {type(e).__name__}: {e}")

    def _absorb(self, rec: Record, res: Any, routes_start: int | None) -> None:
        m = len(res.output_ids)
        gen_routes = None
        if self.route_shape is not None and res.routes is not None:
            routes = res.routes
            if routes_start == 0:
                p = len(rec.prompt) - 1
                if m >= 1 and routes.shape[0] == p + m:
                    rec.prompt_routes = routes[:p].astype(self.route_shape.dtype)
                routes = routes[p:] if routes.shape[0] >= p else routes[:0]
            if routes.shape[0] == m and routes.shape[1:] == (self.route_shape.layers, self.route_shape.top_k):
                gen_routes = routes
            else:
                log.warning(
                    "response %s: %s routes for %d tokens; recorded as unknown", rec.rid, routes.shape, m
                )
        rec.append(res.output_ids, res.logprobs, rec.launch_version, gen_routes)
        self.tokens_generated += m
        if res.finish_type == "abort" and self.paused:
            rec.state = State.PAUSED
        elif res.finish_type in ("stop", "length"):
            rec.matched_stop = res.matched_stop
            self._finish(rec, res.finish_type)
        else:
            self._finish(rec, "error", res.error or f"the engine ended the request ({res.finish_type})")

    def _finish(self, rec: Record, reason: str, error: str | None = None) -> None:
        rec.state = State.FINISHED
        rec.finish_reason = reason
        rec.error = error
        rec.task = None
        self._seq += 1
        self._events.append(rec.take_delta(seq=self._seq))
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    async def _stop_running(self, recs: list[Record]) -> float:
        """Abort every engine request and wait until each has returned its partial output."""
        tasks = [r.task for r in recs if r.task is not None]
        if not tasks:
            return 0.0
        t0 = time.perf_counter()
        self.engine.abort_all()
        _, pending = await asyncio.wait(tasks, timeout=0.05)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise ProtocolError(ErrorCode.ENGINE_ERROR, f"{len(pending)} engine requests did not stop")
            self.engine.abort_all()  # a request still on its way to the scheduler missed the first abort
            _, pending = await asyncio.wait(pending, timeout=0.2)
        return time.perf_counter() - t0

    def _running(self) -> list[Record]:
        return [r for r in self.records.values() if r.state is State.RUNNING]

    def _require_idle(self, what: str) -> None:
        n = len(self._running())
        if n:
            raise ProtocolError(
                ErrorCode.BUSY, f"{what} needs no generating responses, but {n} are running; pause first"
            )

    def _lookup(self, rids: list[str]) -> list[Record]:
        missing = [r for r in rids if r not in self.records]
        if missing:
            raise ProtocolError(
                ErrorCode.UNKNOWN_RESPONSE,
                f"unknown response id(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                f"({len(missing)} of {len(rids)}); nothing was changed",
                {"rids": missing[:100]},
            )
        return [self.records[r] for r in rids]

    # ------------------------------------------------------------------------------------- commands

    async def _op_submit(self, body: SubmitBody, msg: Message):
        if body.expect_version is not None and body.expect_version != self.version:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"submit expects weights version {body.expect_version} but the server serves {self.version}",
            )
        items = body.items
        prompts = msg.array("prompt_ids", ["int32"], 1)
        prefixes = msg.array("prefix_ids", ["int32"], 1, required=False)
        plens = [it.prompt_len for it in items]
        xlens = [it.prefix_len for it in items]
        if len(prompts) != sum(plens):
            raise ProtocolError(
                ErrorCode.INVALID,
                f"prompt_ids has {len(prompts)} ids but the items' prompt_len sum to {sum(plens)}",
            )
        if prefixes is None:
            prefixes = np.zeros(0, np.int32)
        if len(prefixes) != sum(xlens):
            raise ProtocolError(
                ErrorCode.INVALID,
                f"prefix_ids has {len(prefixes)} ids but the items' prefix_len sum to {sum(xlens)}",
            )
        extra = self._submit_extras(msg, plens, xlens)
        seen: set[str] = set()
        dup = []
        for it in items:
            if it.rid in self.records or it.rid in seen:
                dup.append(it.rid)
            seen.add(it.rid)
        if dup:
            raise ProtocolError(
                ErrorCode.DUPLICATE_RESPONSE,
                f"response id(s) already in use: {dup[:10]}; nothing was submitted",
            )
        vocab = self.info.vocab_size
        for arr, what in ((prompts, "prompt_ids"), (prefixes, "prefix_ids")):
            if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
                raise ProtocolError(ErrorCode.INVALID, f"{what} holds ids outside [0, {vocab})")
        for sp, what in [(body.sampling, "sampling")] + [
            (it.sampling, f"items.{i}.sampling") for i, it in enumerate(items) if it.sampling is not None
        ]:
            if sp.stop_token_ids and max(sp.stop_token_ids) >= vocab:
                raise ProtocolError(ErrorCode.INVALID, f"{what}.stop_token_ids holds ids outside [0, {vocab})")
        ctx = getattr(self.engine, "context_len", 0)
        for it in items:
            if it.prefix_len >= it.max_new_tokens:
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"response {it.rid}: prefix_len {it.prefix_len} leaves no budget of max_new_tokens {it.max_new_tokens}",
                )
            if ctx and it.prompt_len + it.max_new_tokens > ctx:
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"response {it.rid}: prompt {it.prompt_len} + max_new_tokens {it.max_new_tokens} exceed the "
                    f"context length {ctx}",
                )
            if ctx and it.prompt_len + it.prefix_len >= ctx:
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"response {it.rid}: prompt + prefix of {it.prompt_len + it.prefix_len} tokens reach the context length {ctx}",
                )
        p = x = q = 0
        new = []
        dumped: dict[int, dict] = {}  # one SGLang sampling dict per distinct SamplingParams object
        for it in items:
            sp = it.sampling or body.sampling
            args = dumped.get(id(sp))
            if args is None:
                args = dumped[id(sp)] = sp.model_dump(exclude_none=True)
            sl, xl = slice(p, p + it.prompt_len), slice(x, x + it.prefix_len)
            ql = slice(q, q + it.prompt_len - 1)
            new.append(
                new_record(
                    it.rid,
                    prompts[sl],
                    prefixes[xl],
                    it.max_new_tokens,
                    sp,
                    self.route_shape,
                    prefix_logprobs=_part(extra["prefix_logprobs"], xl),
                    prefix_versions=_part(extra["prefix_versions"], xl),
                    prefix_routes=_part(extra["prefix_routed_experts"], xl),
                    prompt_routes=_part(extra["prompt_routed_experts"], ql),
                    sampling_args=args,
                )
            )
            p, x, q = p + it.prompt_len, x + it.prefix_len, q + it.prompt_len - 1
        for rec in new:
            self.records[rec.rid] = rec
            if not self.paused:
                self._launch(rec)
        return {"accepted": len(new), "version": self.version, "paused": self.paused}, None, None

    def _submit_extras(
        self, msg: Message, plens: list[int], xlens: list[int]
    ) -> dict[str, np.ndarray | None]:
        nx = sum(xlens)
        out: dict[str, np.ndarray | None] = {
            "prefix_logprobs": msg.array("prefix_logprobs", ["float32"], 1, required=False),
            "prefix_versions": msg.array("prefix_versions", ["int32"], 1, required=False),
            "prefix_routed_experts": None,
            "prompt_routed_experts": None,
        }
        for k in ("prefix_logprobs", "prefix_versions"):
            if out[k] is not None and len(out[k]) != nx:
                raise ProtocolError(ErrorCode.INVALID, f"{k} has {len(out[k])} entries, prefix_ids {nx}")
        vers = out["prefix_versions"]
        if vers is not None and len(vers) and int(vers.min()) < -1:
            raise ProtocolError(
                ErrorCode.INVALID, f"prefix_versions holds {int(vers.min())}; versions are -1 (unknown) or >= 0"
            )
        for k, rows in (("prefix_routed_experts", nx), ("prompt_routed_experts", sum(plens) - len(plens))):
            arr = msg.array(k, ["uint8", "int16", "int32", "int64"], 3, required=False)
            if arr is None:
                continue
            if self.route_shape is None:
                raise ProtocolError(
                    ErrorCode.INVALID, f"{k}: this server returns no routed experts (health: routed_experts)"
                )
            rs = self.route_shape
            if arr.shape != (rows, rs.layers, rs.top_k):
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"{k} has shape {list(arr.shape)}, expected {[rows, rs.layers, rs.top_k]}",
                )
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= int(self.info.num_experts)):
                raise ProtocolError(
                    ErrorCode.INVALID, f"{k} holds expert ids outside [0, {self.info.num_experts})"
                )
            out[k] = arr
        return out

    async def _op_pause(self, body, msg):
        if self.paused:
            raise ProtocolError(
                ErrorCode.ALREADY_PAUSED,
                "the server is already paused; resume it first (nothing was changed)",
            )
        self.paused = True
        running = self._running()
        engine_s = await self._stop_running(running)
        t0 = time.perf_counter()
        outputs = [r.take_delta() for r in running if r.state is State.PAUSED]
        body_out, arrays = encode_outputs(outputs, route_shape=self.route_shape)
        body_out.update(
            event_seq=self._seq, engine_s=engine_s, server_s=time.perf_counter() - t0, version=self.version
        )
        return body_out, arrays, None

    async def _op_resume(self, body, msg):
        if not self.paused:
            raise ProtocolError(ErrorCode.NOT_PAUSED, "the server is not paused; nothing to resume")
        t0 = time.perf_counter()
        self.paused = False
        live = [r for r in self.records.values() if r.state is State.PAUSED]
        for rec in live:
            self._launch(rec)
        return (
            {"resumed": len(live), "version": self.version, "server_s": time.perf_counter() - t0},
            None,
            None,
        )

    async def _op_truncate(self, body: TruncateBody, msg):
        recs = self._lookup(list(body.keep))
        running = [r.rid for r in recs if r.state is State.RUNNING]
        if running:
            raise ProtocolError(
                ErrorCode.RESPONSE_RUNNING,
                f"response(s) {running[:10]} are generating; pause first (nothing was changed)",
            )
        bad = [(r.rid, body.keep[r.rid], len(r)) for r in recs if not 0 <= body.keep[r.rid] <= len(r)]
        if bad:
            rid, keep, n = bad[0]
            raise ProtocolError(
                ErrorCode.KEEP_OUT_OF_RANGE,
                f"keep length {keep} for response {rid} is outside [0, {n}] ({len(bad)} bad); nothing was changed",
                {"rids": [b[0] for b in bad[:100]]},
            )
        revived = []
        cut = 0
        for rec in recs:
            keep = body.keep[rec.rid]
            cut += len(rec) - keep
            was_finished = rec.state is State.FINISHED
            rec.truncate(keep)
            if was_finished and rec.state is State.PAUSED:
                revived.append(rec.rid)
                if not self.paused:
                    self._launch(rec)
        return {"truncated": len(recs), "tokens_cut": cut, "revived": revived}, None, None

    async def _op_drop(self, body: DropBody, msg):
        if body.all == (body.rids is not None):
            raise ProtocolError(ErrorCode.INVALID, "drop needs either rids or all=true")
        recs = list(self.records.values()) if body.all else self._lookup(body.rids)
        for rec in recs:
            if rec.state is State.RUNNING and rec.task is not None:
                self._spawn(self._drain(rec.task, f"{rec.rid}#{rec.launches}"))
            del self.records[rec.rid]
            rec.state = State.FINISHED
        return {"dropped": len(recs)}, None, None

    async def _drain(self, task: asyncio.Task, erid: str) -> None:
        """Abort a dropped request until it has ended (an abort can overtake a request still on its way)."""
        for _ in range(int(STOP_TIMEOUT_S / 0.2)):
            self.engine.abort(erid)
            await asyncio.wait([task], timeout=0.2)
            if task.done():
                return
        log.warning("dropped request %s did not stop", erid)

    async def _op_update_weights(self, body: UpdateWeightsBody, msg: Message):
        self._require_idle("update_weights")
        staged = self._staged
        if body.bucket == 0:
            staged = _Staged(version=body.version)
        elif staged is None or staged.version != body.version or staged.next_bucket != body.bucket:
            self._staged = None
            expect = (
                "bucket 0" if staged is None else f"bucket {staged.next_bucket} of version {staged.version}"
            )
            raise ProtocolError(
                ErrorCode.WEIGHT_SEQUENCE,
                f"got bucket {body.bucket} of version {body.version} but expected {expect}; the staged update was "
                "discarded and the old weights keep serving",
            )
        self._staged = None  # re-set below only if this bucket is valid
        tensors = self._decode_tensors(msg)
        staged.buckets.append(tensors)
        staged.next_bucket += 1
        if not body.commit:
            self._staged = staged
            return {"version": self.version, "committed": False, "staged": staged.count}, None, None
        t0 = time.perf_counter()
        async with self._engine_call():
            await self.engine.update_tensors(staged.buckets)
        self.version = body.version
        return (
            {
                "version": self.version,
                "committed": True,
                "tensors": staged.count,
                "engine_s": time.perf_counter() - t0,
            },
            None,
            None,
        )

    def _decode_tensors(self, msg: Message) -> list[tuple[str, Any]]:
        """Validate every tensor of a bucket against the served checkpoint, then build owned torch tensors."""
        import torch

        problems = []
        for name, (spec, _raw) in msg.frames.items():
            known = self.info.weights.get(name)
            if known is None:
                problems.append(f"unknown weight name {name!r}")
            elif spec.dtype not in WEIGHT_DTYPES:
                problems.append(
                    f"weight {name!r} has dtype {spec.dtype}; expected one of {list(WEIGHT_DTYPES)}"
                )
            elif tuple(spec.shape) != known[0]:
                problems.append(f"weight {name!r} has shape {spec.shape} but the model's is {list(known[0])}")
        if problems:
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID,
                "; ".join(problems[:5])
                + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                + ". Nothing was applied: the old weights keep serving",
                {"problems": problems[:100]},
            )
        out = []
        for name, (spec, raw) in msg.frames.items():
            dt = getattr(torch, spec.dtype)
            t = torch.frombuffer(bytearray(raw), dtype=dt) if raw.nbytes else torch.zeros(0, dtype=dt)
            if not _finite(t):
                problems.append(f"weight {name!r} holds non-finite values (NaN or inf)")
            out.append((name, t.reshape(spec.shape)))
        if problems:
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID,
                "; ".join(problems[:5]) + ". Nothing was applied: the old weights keep serving",
                {"problems": problems[:100]},
            )
        return out

    async def _op_update_weights_from_disk(self, body: UpdateWeightsFromDiskBody, msg):
        from sglang_ext.engine import ModelFolderError, inspect_model_folder

        self._require_idle("update_weights_from_disk")
        try:
            other = inspect_model_folder(body.path)
        except (ModelFolderError, OSError, ValueError) as e:  # OSError/ValueError: an unusable path (NUL, too long)
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID, f"{_short_path(body.path)}: {e}; the old weights keep serving"
            ) from None
        mine, theirs = self.info.weights, other.weights
        problems = [f"missing weight {n!r}" for n in mine if n not in theirs]
        problems += [f"unknown weight name {n!r}" for n in theirs if n not in mine]
        problems += [
            f"weight {n!r} has shape {list(theirs[n][0])} but the model's is {list(s)}"
            for n, (s, _) in mine.items()
            if n in theirs and theirs[n][0] != s
        ]
        problems += [
            f"weight {n!r} has dtype {d}; expected one of {list(WEIGHT_DTYPES)}"
            for n, (_, d) in theirs.items()
            if n in mine and d not in WEIGHT_DTYPES and mine[n][1] in WEIGHT_DTYPES
        ]
        if problems:
            raise ProtocolError(
                ErrorCode.WEIGHT_INVALID,
                f"{body.path}: "
                + "; ".join(problems[:5])
                + ". Nothing was applied: the old weights keep serving",
            )
        t0 = time.perf_counter()
        async with self._engine_call():
            await self.engine.update_from_disk(str(other.path))
        self.version = body.version
        return {"version": self.version, "committed": True, "engine_s": time.perf_counter() - t0}, None, None

    async def _op_flush(self, body, msg):
        self._require_idle("flush")
        async with self._engine_call():
            await self.engine.flush()
        return {"flushed": True}, None, None

    async def _op_shutdown(self, body, msg):
        asyncio.get_running_loop().call_later(0.01, self.request_stop, "shutdown command")
        return {"stopping": True}, None, None

    # ------------------------------------------------------------------------------------- queries

    async def _op_events(self, body: EventsBody, msg):
        while self._events and self._events[0].seq <= body.after:
            self._events.popleft()
        if not self._events and body.wait_s > 0 and not self._stopping:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.add(fut)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, body.wait_s)
            self._waiters.discard(fut)
        batch = [e for _, e in zip(range(body.max_events), self._events, strict=False)]
        out, arrays = encode_outputs(batch, seqs=True, route_shape=self.route_shape)
        out["last_seq"] = self._seq
        return out, arrays, None

    async def _op_fetch(self, body: FetchBody, msg):
        recs = list(self.records.values()) if body.rids is None else self._lookup(body.rids)
        out, arrays = encode_outputs([r.snapshot() for r in recs], route_shape=self.route_shape)
        out["states"] = [r.state.value for r in recs]
        out["prompt_lens"] = [len(r.prompt) for r in recs]
        out["max_new_tokens"] = [r.max_new_tokens for r in recs]
        return out, arrays, None

    async def _op_stats(self, body: StatsBody, msg):
        counts = {s.value: 0 for s in State}
        cached = 0
        for r in self.records.values():
            counts[r.state.value] += 1
            cached += len(r)
        out = {
            "version": self.version,
            "paused": self.paused,
            "live": counts["running"] + counts["paused"],
            "running": counts["running"],
            "paused_responses": counts["paused"],
            "finished": counts["finished"],
            "tokens_generated": self.tokens_generated,
            "tokens_cached": cached,
            "events_pending": len(self._events),
            "last_seq": self._seq,
            "commands_queued": self._commands.qsize(),
            "engine_inflight": self.engine.inflight(),
            "uptime_s": time.time() - self.started,
        }
        if body.engine:
            async with self._engine_call():
                out["engine"] = await self.engine.loads()
        return out, None, None

    async def _op_weights(self, body, msg):
        weights = [
            {"name": n, "shape": list(shape), "dtype": dtype} for n, (shape, dtype) in self.info.weights.items()
        ]
        return {"weights": weights, "version": self.version}, None, None

    async def _op_health(self, body, msg):
        alive = self.engine.children_alive()
        return (
            {
                "ok": alive and not self._stopping,
                "engine_alive": alive,
                "stopping": self._stopping,
                "version": self.version,
                "paused": self.paused,
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                **self._model_info(),
            },
            None,
            None,
        )


def _part(arr: np.ndarray | None, sl: slice) -> np.ndarray | None:
    return None if arr is None else arr[sl]


def _finite(t: Any) -> bool:
    """Whether every value of a float tensor is finite. One sum in the tensor's own dtype (a vectorized pass, ~30 ms
    for 200 MB): NaN or inf anywhere makes it non-finite; only then the exact check, since a sum of finite values
    can overflow (float16 above 65504)."""
    import torch

    if not t.numel() or math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _short_path(path: str) -> str:
    return repr(path) if len(path) <= 200 else repr(path[:197] + "...")


# ---------------------------------------------------------------------------------------------- entry points


def serve(cfg: ServeConfig) -> None:
    """Check the configuration and the model folder, start SGLang, serve until shutdown, leave no child behind."""
    from sglang_ext import cpu_compat
    from sglang_ext.engine import EngineHandle, inspect_model_folder

    check_config(cfg)
    info = inspect_model_folder(cfg.model)
    routes = info.is_moe if cfg.routed_experts is None else cfg.routed_experts
    if routes and not info.is_moe:
        raise ConfigError(f"--routed-experts on, but {info.path} is not a mixture-of-experts model")
    cpu_compat.activate()
    engine = EngineHandle.start(info, routes=routes, **cfg.engine)
    try:
        engine.enable_idle_nice(cfg.idle_nice)
        server = ControlServer(cfg, engine)
        engine.loop.run_until_complete(_bind_and_run(server))
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        log.info("SGLang shut down in %.1f s", time.monotonic() - t0)


async def _bind_and_run(server: ControlServer) -> None:
    server.bind()
    await server.run()


def _parse_engine_arg(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise ConfigError(f"--engine-arg {item!r} must be KEY=VALUE")
        try:
            out[key.replace("-", "_")] = json.loads(val)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = val
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollverify serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder (safetensors)")
    p.add_argument(
        "--control", default="tcp://127.0.0.1:0", help="ZMQ endpoint to bind; port 0 picks a free port"
    )
    p.add_argument(
        "--curve-secret-key", help="zmq certificate with the server's secret key (needed off loopback)"
    )
    p.add_argument(
        "--curve-authorized-keys", help="folder of client public-key certificates allowed to connect"
    )
    p.add_argument(
        "--routed-experts",
        choices=["auto", "on", "off"],
        default="auto",
        help="return MoE routes (auto: on for MoE)",
    )
    p.add_argument("--ready-file", help="write endpoint, pid and model facts as JSON here once serving")
    p.add_argument(
        "--exit-with-parent", action="store_true", help="shut down when the launching process dies"
    )
    p.add_argument(
        "--weights-version", type=int, default=0, help="version recorded on tokens before any update"
    )
    p.add_argument(
        "--idle-nice",
        type=int,
        default=19,
        help="niceness of SGLang's processes while nothing generates (their idle loop spins a core); 0: unchanged",
    )
    p.add_argument("--dtype", help="engine dtype (CPU default float32)")
    p.add_argument("--tp-size", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sglang.Engine argument",
    )
    return p


def config_from_args(a: argparse.Namespace) -> ServeConfig:
    engine = _parse_engine_arg(a.engine_arg)
    for key in ("dtype", "tp_size", "mem_fraction_static", "max_total_tokens", "max_running_requests"):
        if getattr(a, key) is not None:
            engine[key] = getattr(a, key)
    engine["log_level"] = a.log_level
    return ServeConfig(
        model=a.model,
        control=a.control,
        curve_secret_key=a.curve_secret_key,
        curve_authorized_keys=a.curve_authorized_keys,
        routed_experts={"auto": None, "on": True, "off": False}[a.routed_experts],
        ready_file=a.ready_file,
        exit_with_parent=a.exit_with_parent,
        version=a.weights_version,
        idle_nice=a.idle_nice,
        engine=engine,
    )


def cli_main(argv: list[str] | None = None) -> int:
    from sglang_ext.engine import EngineStartError, ModelFolderError

    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="[%(asctime)s] %(name)s %(levelname)s: %(message)s")
    logging.getLogger("sglang_ext").setLevel(logging.INFO)  # our own lifecycle lines, whatever SGLang's level
    try:
        serve(config_from_args(a))
    except (ConfigError, ModelFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
