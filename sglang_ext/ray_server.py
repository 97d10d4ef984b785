"""SGLang servers as Ray actors (`cluster.launcher: ray`); the application places each on the bundle of its plan
node (rollverify.app.ray_placement).

A `ServerActor` runs the same server process as the local launcher (sglang_ext.launch.launch_server), bound to
its node's address, with the plan's GPUs (`base_gpu_id` = the plan's first GPU of the server; Ray leaves every
GPU of the node visible, see rollverify.app.cluster). An endpoint off loopback never runs without CURVE: the driver
makes the run's keys (`RunKeys`), each actor writes the server's certificate and the client's public key into a
private folder on its node ($TMPDIR/rollverify-keys-serverN-*, mode 0700, the secret 0600), and the rollout
engine's client connects with the matching client keys. The server reads them once, when it binds (before it
reports ready), so the folder is removed as soon as its start returns, whether it started or not: the keys stay
on disk only while a server starts, and a run killed later leaves none behind.

The driver holds a `RayServer` per server: the handle the rollout engine's watchdog reads (`alive()`, which is
false once the server process exits or its actor dies) and stops. `RayServer.start_many` starts actors the
application placed and checks each one's start; the application's `relaunch(i)` places a fresh actor on the same
plan node, and the engine then pushes the current policy to it and resubmits the responses the lost one held.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_ext.client import CurveKeys


@dataclass(frozen=True)
class RunKeys:
    """A run's CURVE keys (Z85): the servers' key pair and the client's, made by the driver for this run."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def make(cls) -> RunKeys:
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def client(self) -> CurveKeys:
        return CurveKeys(self.server_public, self.client_public, self.client_secret)

    def for_server(self) -> ServerKeys:
        """What a server gets: its own pair and the one client key it admits (never the client's secret)."""
        return ServerKeys(self.server_public, self.server_secret, self.client_public)


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    client_public: bytes

    def write(self, folder: Path) -> tuple[Path, Path]:
        """The server certificate and the folder of admitted client keys, in zmq's certificate format, readable
        by this user only. Returns (secret certificate, authorized-keys folder)."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        authorized = folder / "clients"
        authorized.mkdir(mode=0o700, exist_ok=True)
        secret = folder / "server.key_secret"
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(_cert(self.public, self.secret))
        (authorized / "client.key").write_text(_cert(self.client_public))
        return secret, authorized


def _cert(public: bytes, secret: bytes | None = None) -> str:
    lines = ["metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


class ServerActor:
    """One server process on this actor's node (a Ray actor with two threads: `wait_exit` blocks in one)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.server = None
        self._stopping = threading.Event()
        self._folder: Path | None = None  # the server's log where the run folder is not on this node

    def start(self, model: str, engine_args: dict[str, Any], keys: ServerKeys, log_path: str | None,
              startup_timeout_s: float) -> dict[str, Any]:
        import ray

        from sglang_ext import cpu_compat
        from sglang_ext.launch import launch_server

        cpu_compat.activate()
        ip = ray.util.get_node_ip_address()
        if log_path and Path(log_path).parent.is_dir():
            log = Path(log_path)
        else:
            self._folder = Path(tempfile.mkdtemp(prefix=f"rollverify-server{self.index}-"))
            log = self._folder / "server.log"
        keys_dir = Path(tempfile.mkdtemp(prefix=f"rollverify-keys-server{self.index}-"))
        try:
            secret, authorized = keys.write(keys_dir)
            self.server = launch_server(
                model,
                control=f"tcp://{ip}:0",
                args=["--curve-secret-key", str(secret), "--curve-authorized-keys", str(authorized)],
                engine_args=engine_args,
                log_path=log,
                startup_timeout_s=startup_timeout_s,
            )
        finally:  # the server has loaded them (or will never start): nothing reads them again
            shutil.rmtree(keys_dir, ignore_errors=True)
        return {"endpoint": self.server.endpoint, "pid": self.server.pid, "log": str(log),
                "node_id": ray.get_runtime_context().get_node_id()}

    def wait_exit(self) -> int | None:
        """Returns when the server process exits (its exit code) or `stop` is called (None)."""
        while not self._stopping.wait(0.2):
            if self.server is not None and self.server.proc.poll() is not None:
                return self.server.proc.returncode
        return None

    def log_tail(self) -> str:
        return self.server.log_tail() if self.server is not None else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        if self.server is not None:
            self.server.stop(timeout_s)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


class RayServer:
    """The driver's handle on server `index` (the rollout engine watches and stops it)."""

    def __init__(self, index: int, where: str, actor: Any, info: dict[str, Any]) -> None:
        self.index, self.where, self.actor, self.info = index, where, actor, info
        self.endpoint: str = info["endpoint"]
        self.pid: int = info["pid"]
        self._exit = actor.wait_exit.remote()

    def alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self._exit], timeout=0)
        return not ready

    def stop(self, timeout_s: float = 30.0) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + 10)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)

    def __str__(self) -> str:
        return f"server {self.index} ({self.where}, {self.endpoint}, pid {self.pid})"


def check_keys(servers: list[RayServer], keys: CurveKeys, timeout_s: float = 30.0) -> None:
    """Every server answers a health request over CURVE with `keys`; else a ServerStartError naming each server
    that did not (a CURVE handshake with keys that do not match gets no answer at all, only silence)."""
    import asyncio

    from sglang_ext.client import ControlError, ServerConnection
    from sglang_ext.launch import ServerStartError

    async def one(s: RayServer) -> str:
        conn = await ServerConnection(s.endpoint, curve=keys, timeout_s=timeout_s).start()
        try:
            await conn.health(timeout_s=timeout_s)
            return ""
        except ControlError as e:
            return (f"{s}: no answer within {timeout_s:g} s over CURVE with this run's client keys (server key "
                    f"{keys.server_public_key.decode()[:8]}...): the keys do not match the server's, or its "
                    f"address is not reachable from the driver ({e.code})")
        finally:
            await conn.close()

    async def every() -> list[str]:
        return list(await asyncio.gather(*(one(s) for s in servers)))

    problems = [p for p in asyncio.run(every()) if p]
    if problems:
        raise ServerStartError("\n".join(problems))
