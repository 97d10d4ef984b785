"""`rollverify serve`: one SGLang engine behind a ZMQ control channel (see docs/protocol.md).

The server owns the cache of every response it generates. Pause aborts all engine requests and hands the
controller each live response's output since its last report; truncation cuts the cache; resume relaunches
every live response from prompt + kept tokens under the current weights; weight updates are validated in full
before any of them reaches SGLang. Commands run one at a time in arrival order; queries (events, stats, health,
fetch, weights) are answered beside them.

`ControlServer` assembles the parts, each in its own module: `channel` (socket, CURVE, framing), `dispatch`
(decoding, the op table, the command worker, error replies), `records` (the responses and their engine
requests) and the op groups of `sglang_ext.handlers`, listed in `OP_GROUPS` (how to add one: `sglang_ext/handlers/__init__.py`).
`serve_config` holds the configuration and its checks; this module the `serve` entry and its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sglang_ext.channel import Channel
from sglang_ext.dispatch import Dispatcher, OpGroup
from sglang_ext.handlers.admin import AdminHandlers
from sglang_ext.handlers.generation import GenerationHandlers
from sglang_ext.handlers.logprobs import LogprobHandlers
from sglang_ext.handlers.transport import TransportHandlers
from sglang_ext.handlers.weights import WeightHandlers
from sglang_ext.protocol import PROTOCOL_VERSION
from sglang_ext.records import EngineCalls, Records
from sglang_ext.serve_config import ServeConfig, ServeConfigError, check_config, check_endpoint
from sglang_ext.store import State

__all__ = [
    "OP_GROUPS",
    "ControlServer",
    "ServeConfig",
    "ServeConfigError",
    "build_parser",
    "check_config",
    "check_endpoint",
    "cli_main",
    "config_from_args",
    "serve",
]

SERVING = threading.Event()  # set once the control channel serves (the parent guard then stops gracefully)
log = logging.getLogger(__name__)

# every op group the server registers; a new group is one more entry (see sglang_ext/handlers/__init__.py)
OP_GROUPS: tuple[Callable[[ControlServer], OpGroup], ...] = (GenerationHandlers, WeightHandlers, TransportHandlers, LogprobHandlers, AdminHandlers)


class ControlServer:
    """The control channel around one EngineHandle (or any object with the same coroutines, for tests): its
    lifecycle (bind, serve until stopped, tear down) and the parts the op groups share."""

    def __init__(self, cfg: ServeConfig, engine: Any):
        self.cfg = cfg
        self.engine = engine
        self.info = engine.info
        self.started = time.time()
        self._stop = asyncio.Event()
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()
        self.channel = Channel(cfg)
        self.engine_calls = EngineCalls(getattr(engine, "set_idle", None))
        self.records = Records(engine, cfg.version, self.engine_calls, self.spawn)
        self.dispatcher = Dispatcher(self.channel, self.spawn, lambda: self._stopping)
        for group in OP_GROUPS:
            self.dispatcher.register(group(self).handlers())
        self.dispatcher.check_complete()

    @property
    def endpoint(self) -> str | None:
        return self.channel.endpoint

    @property
    def stopping(self) -> bool:
        return self._stopping

    def bind(self) -> str:
        """Create and bind the socket (before the loop runs, so a taken port fails fast)."""
        return self.channel.bind()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        """A task the teardown cancels if it is still running."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def request_stop(self, reason: str = "signal") -> None:
        if not self._stopping:
            log.info("stopping (%s)", reason)
        self._stopping = True
        self._stop.set()

    async def run(self) -> None:
        """Serve until shutdown (a command, SIGTERM/SIGINT, or the parent's death with exit_with_parent)."""
        if self.channel.sock is None:
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
        self.spawn(self.dispatcher.command_worker())
        self._write_ready()
        SERVING.set()
        log.info("control channel on %s (model %s)", self.endpoint, self.info.path)
        recv = None
        try:
            while not self._stop.is_set():
                recv = asyncio.ensure_future(self.channel.recv())
                stop = asyncio.ensure_future(self._stop.wait())
                done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if recv in done:
                    frames = recv.result()
                    recv = None
                    self.dispatcher.on_frames(frames)
        finally:
            if recv is not None:
                recv.cancel()
            await self._teardown()

    async def _teardown(self) -> None:
        running = self.records.in_state(State.RUNNING)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.records.stop_running(running), 10.0)
        await asyncio.sleep(0.05)  # let the shutdown reply leave
        for t in list(self._tasks):
            t.cancel()
        self.channel.close()
        log.info("control channel closed")

    def _write_ready(self) -> None:
        if not self.cfg.ready_file:
            return
        info = {
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "version": self.records.version,
            **self.model_info(),
        }
        path = Path(self.cfg.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)

    def model_info(self) -> dict[str, Any]:
        """The served model's facts, as the ready file and health report them."""
        rs = self.records.route_shape
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


# ---------------------------------------------------------------------------------------------- entry points


def serve(cfg: ServeConfig) -> None:
    """Check the configuration and the model folder, start SGLang, serve until shutdown, leave no child behind."""
    from sglang_ext import cpu_compat
    from sglang_ext.engine import EngineHandle, inspect_model_folder

    check_config(cfg)
    if cfg.exit_with_parent:
        guard_parent(cfg.parent_pid or os.getppid())
    info = inspect_model_folder(cfg.model)
    routes = info.is_moe if cfg.routed_experts is None else cfg.routed_experts
    if routes and not info.is_moe:
        raise ServeConfigError(f"--routed-experts on, but {info.path} is not a mixture-of-experts model")
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


def guard_parent(parent: int, grace_s: float = 30.0) -> None:
    """End this server when process `parent` is gone, from start-up on (a thread: the engine's start takes
    minutes and blocks the event loop). Serving: SIGTERM, a graceful stop that shuts SGLang down, then SIGKILL
    after `grace_s`. Still starting: SIGKILL to every process under this one, then to this one (a SGLang child
    that is still importing has not set its PR_SET_PDEATHSIG yet, and would outlive a server that only exits)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.warning("parent process %d is gone: stopping", parent)
        if SERVING.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
        _kill_tree()

    threading.Thread(target=watch, name="rollverify-parent-guard", daemon=True).start()


def _kill_tree() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


async def _bind_and_run(server: ControlServer) -> None:
    server.bind()
    await server.run()


def _parse_engine_arg(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise ServeConfigError(f"--engine-arg {item!r} must be KEY=VALUE")
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
    p.add_argument("--parent-pid", type=int, help="with --exit-with-parent: the launching process (default: the "
                   "parent at start; give it to cover a launcher that dies while this one starts)")
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
        parent_pid=a.parent_pid,
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
    except (ServeConfigError, ModelFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
