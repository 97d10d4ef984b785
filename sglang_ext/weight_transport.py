"""The server wing's end of the weight transports from the trainer's ranks straight to the SGLang servers; ZMQ
carries control only.

    placement       transport      data path of each bucket
    local launcher  in_memory      trainer -> driver -> ZMQ frames -> server (`SGLangRolloutEngine.update_weights`)
    disaggregated   distributed    trainer source rank --broadcast (NCCL; gloo on CPU)--> every server's TP ranks
    colocated       ipc            trainer rank --CUDA IPC handle (shared memory on CPU)--> the server on its GPUs

`ServerControl` is a trainer rank's `BucketControl` (megatron_bridge.weight_sync): its own ZMQ connections to the
servers of a `ServerTargets` (the server handlers of `sglang_ext/handlers/transport.py`), while the trainer wing's sender
moves the bytes; the application joins the two (rollverify.app.weight_transport). A version is committed on the
servers only after every server has loaded every bucket; any failure aborts the stream on every server, which
then keeps reporting its old version (see the handlers module for a half-loaded engine) and the error names the
server.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sglang_ext.client import ControlError, CurveKeys, ServerConnection

log = logging.getLogger(__name__)


class ServerTargets(Protocol):
    """The servers a `ServerControl` drives and how: `kind` (distributed: a broadcast over the weight-update group
    `group`; ipc: payloads in the messages), each server's endpoint, CURVE keys and TP size (`tp(i)`), the group's
    backend (None: NCCL with a GPU, gloo without) and source address (None: this host's), and the reply timeout."""

    kind: Literal["distributed", "ipc"]
    endpoints: tuple[str, ...]
    curve: tuple[CurveKeys | None, ...]
    group: str
    backend: str | None
    master_addr: str | None
    timeout_s: float

    def tp(self, server: int) -> int: ...


# joins the weight-update group as its rank 0: (master_addr, master_port, world_size, group name, backend,
# timeout_s) -> the process group (megatron_bridge.weight_sync.join_weight_group)
JoinGroup = Callable[[str, int, int, str, str, float], Any]

# weight-update groups this process joined as rank 0, by name: they outlive one sync (joining costs a rendezvous)
_GROUPS: dict[str, Any] = {}


@dataclass
class _Pending:
    index: int
    calls: dict[int, Any] = field(default_factory=dict)  # server index -> concurrent future of its reply


class ServerControl:
    """The `BucketControl` of one trainer rank: its own ZMQ connections to its servers, on an event loop of its
    own (the trainer's thread blocks in the broadcast while the servers' replies are outstanding)."""

    def __init__(self, spec: ServerTargets, servers: list[int]) -> None:
        self.spec, self.servers = spec, servers
        self.kind = spec.kind
        self.op = "update_weights_distributed" if spec.kind == "distributed" else "update_weights_ipc"
        self.version = -1
        self.pending: _Pending | None = None
        self.served: dict[int, dict[str, tuple[list[int], str]]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-transport", daemon=True)
        self._thread.start()
        self.conns: dict[int, ServerConnection] = {}
        try:
            for i in servers:
                curve = spec.curve[i] if spec.curve else None
                conn = ServerConnection(spec.endpoints[i], curve=curve, timeout_s=spec.timeout_s)
                self.conns[i] = self._run(conn.start())
        except BaseException:
            self.close()
            raise

    # --- BucketControl ----------------------------------------------------------------------------------

    def begin(self, version: int) -> None:
        """Read each server's checkpoint (names, shapes, dtypes) once, to check buckets before they travel."""
        self.version = version
        for i, conn in self.conns.items():
            if i not in self.served:
                ws = self._run(conn.call("weights")).body["weights"]
                self.served[i] = {w["name"]: (list(w["shape"]), w["dtype"]) for w in ws}

    def announce(self, index: int, meta, payloads: dict[int, list[bytes]] | None = None) -> None:
        """Send bucket `index`'s step to every server without waiting (ipc: server i gets `payloads[i]`, one
        per TP rank); refuse a bucket a server would refuse before anything is sent (a broadcast nobody
        receives would only end at the timeout)."""
        self._check(meta)
        body: dict[str, Any] = {"step": "bucket", "version": self.version, "bucket": index, **meta.as_body()}
        if self.kind == "distributed":
            body["group"] = self.spec.group
        calls = {}
        for i, c in self.conns.items():
            if self.kind == "ipc":
                body = {**body, "payloads": [base64.b64encode(p).decode() for p in (payloads or {}).get(i, [])]}
            calls[i] = self._submit(c.call(self.op, body))
        self.pending = _Pending(index, calls)

    def settle(self, index: int) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None and pending.index == index, f"settle({index}) without its announce"
        self._gather(pending.calls, f"bucket {index} of version {self.version}")

    def commit(self, version: int, buckets: int) -> None:
        self.call_all(self.op, {"step": "commit", "version": version, "buckets": buckets},
                      f"commit of version {version}")

    def abort(self, version: int, reason: str) -> None:
        """Best effort: every server ends the stream; an unreachable one is logged (its own timeout ends it)."""
        if self.pending is not None:  # let the outstanding bucket finish or fail first
            for fut in self.pending.calls.values():
                try:
                    fut.result(self.spec.timeout_s)
                except Exception:  # noqa: BLE001 - the reason is already being reported
                    pass
            self.pending = None
        body = {"step": "abort", "version": version, "reason": reason[:4000]}
        for i, conn in self.conns.items():
            try:
                self._run(conn.call(self.op, body, timeout_s=30.0))
            except Exception as e:  # noqa: BLE001
                log.warning("server %s: abort of version %d not delivered: %s", self.spec.endpoints[i], version, e)

    # --- the weight-update group (distributed) -----------------------------------------------------------

    def join_group(self, join_weight_group: JoinGroup):
        """The weight-update group of `spec.group`, joined now unless this process already has: every server
        is asked to join (rank offsets after this rank 0, by TP size), then this rank joins as rank 0 with
        `join_weight_group`."""
        if self.spec.group in _GROUPS:
            return _GROUPS[self.spec.group]
        import torch

        backend = self.spec.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        addr = self.spec.master_addr or _host_address()
        port = _free_port(addr)
        offsets, world = {}, 1
        for i in range(len(self.spec.endpoints)):
            offsets[i], world = world, world + self.spec.tp(i)
        if set(self.conns) != set(offsets):
            raise ValueError("the distributed transport's source rank must reach every server")
        calls = {
            i: self._submit(c.call("weights_group", {
                "master_addr": addr, "master_port": port, "rank_offset": offsets[i], "world_size": world,
                "group": self.spec.group, "backend": backend,
            }, timeout_s=self.spec.timeout_s))
            for i, c in self.conns.items()
        }
        try:
            group = join_weight_group(addr, port, world, self.spec.group, backend, self.spec.timeout_s)
        except Exception as e:
            failed = self._failures(calls, 1.0)
            raise RuntimeError(
                f"weight-update group {self.spec.group!r} ({backend}, {addr}:{port}, world size {world}) did not "
                f"form within {self.spec.timeout_s:.0f} s: {e}" + (f"; servers: {failed}" if failed else "")
            ) from e
        self._gather(calls, f"joining weight-update group {self.spec.group!r}")
        _GROUPS[self.spec.group] = group
        return group

    def call_all(self, op: str, body: dict[str, Any], what: str) -> None:
        """`op` on every server at once; raises naming each server that failed."""
        self._gather({i: self._submit(c.call(op, body)) for i, c in self.conns.items()}, what)

    # --- plumbing ----------------------------------------------------------------------------------------

    def _check(self, meta) -> None:
        for i, served in self.served.items():
            bad = [n for n, d, s in zip(meta.names, meta.dtypes, meta.shapes, strict=True)
                   if n not in served or served[n][0] != list(s) or d not in ("float32", "bfloat16", "float16")]
            if bad:
                n = bad[0]
                have = served.get(n)
                raise ValueError(
                    f"server {self.spec.endpoints[i]} serves no weight {n!r} of this shape and dtype (it has "
                    f"{'no such name' if have is None else have}); {len(bad)} such tensor(s). Nothing was sent"
                )

    def _submit(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine) -> Any:
        return self._submit(coro).result(self.spec.timeout_s + 30.0)

    def _failures(self, calls: dict[int, Any], timeout: float | None) -> dict[str, str]:
        failed = {}
        for i, fut in calls.items():
            try:
                fut.result(timeout)
            except ControlError as e:
                failed[self.spec.endpoints[i]] = f"{e.code}: {e.message}"
            except Exception as e:  # noqa: BLE001 - a timeout or a closed connection
                failed[self.spec.endpoints[i]] = f"{type(e).__name__}: {e}"
        return failed

    def _gather(self, calls: dict[int, Any], what: str) -> None:
        failed = self._failures(calls, self.spec.timeout_s + 30.0)
        if failed:
            raise RuntimeError(f"{what} failed on {len(failed)} of {len(calls)} server(s): "
                               + "; ".join(f"{ep}: {msg}" for ep, msg in failed.items()))

    def control_bytes(self) -> int:
        return sum(sum(c.bytes_out.values()) for c in self.conns.values())

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                self._run(conn.close())
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)


def _host_address() -> str:
    """This host's address as other hosts reach it (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
