"""What `rollverify serve` is started with, and everything it refuses before it starts SGLang."""

from __future__ import annotations

import contextlib
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_ext.protocol import INT32_MAX


class ServeConfigError(ValueError):
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
    parent_pid: int | None = None  # exit_with_parent: the process whose death ends the server (None: the parent)
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
        raise ServeConfigError(f"--weights-version {cfg.version} is outside [0, {INT32_MAX}]")
    if not 0 <= cfg.idle_nice <= 19:
        raise ServeConfigError(f"--idle-nice {cfg.idle_nice} is outside [0, 19]")
    check_endpoint(cfg)


def check_endpoint(cfg: ServeConfig) -> None:
    """Refuse anything but loopback (or ipc) unless CURVE keys are configured: the channel can replace weights."""
    ep = cfg.control
    if cfg.curve:
        if not cfg.curve_authorized_keys:
            raise ServeConfigError(
                "--curve-secret-key needs --curve-authorized-keys (the folder of client public keys)"
            )
        for p in (cfg.curve_secret_key, cfg.curve_authorized_keys):
            if not Path(p).exists():
                raise ServeConfigError(f"CURVE key path {p} does not exist")
    scheme, _, rest = ep.partition("://")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp" or not rest:
        raise ServeConfigError(f"control endpoint {ep!r} must be tcp://HOST:PORT or ipc://PATH")
    host = rest.rsplit(":", 1)[0].strip("[]")
    loopback = host == "localhost"
    if not loopback:
        with contextlib.suppress(ValueError):
            loopback = ipaddress.ip_address(host).is_loopback
    if not loopback and not cfg.curve:
        raise ServeConfigError(
            f"refusing to bind the control channel to {ep}: it is not a loopback address and no CURVE keys were "
            "given. Anyone who reaches it could replace the model's weights. Bind to tcp://127.0.0.1:PORT, or "
            "pass --curve-secret-key SERVER.key_secret and --curve-authorized-keys CLIENT_KEYS_DIR."
        )
