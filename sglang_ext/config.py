"""The rollout-engine wing's config section: the SGLang servers a run uses (the run config's `servers`).

How many servers `rollverify train` launches (or which running ones it connects to), SGLang's engine arguments
for each, and how long a server may take to start or stay silent. The engine arguments the project itself reads
(`rollverify plan`, the colocated memory handoff, the Ray launcher) are typed fields with SGLang's defaults;
every other SGLang `ServerArgs` key passes through to the engine as given (`EngineArgs.extra`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from rollverify.sections import ConfigError, bounded, check_bounds


@dataclass
class EngineArgs:
    """SGLang `ServerArgs` of every server the run launches. The typed keys are those the project reads; a key
    left at its default here is left to SGLang (None: SGLang sizes it from the model or the hardware). Any
    other key of SGLang's `ServerArgs` is kept in `extra` and passed through unchecked (SGLang refuses what it
    does not know when the server starts)."""

    tp_size: int = bounded(1, ge=1)  # GPUs per server (tensor parallel)
    pp_size: int = bounded(1, ge=1)  # pipeline stages per server (its GPUs: tp_size * pp_size)
    dp_size: int = bounded(1, ge=1)  # data-parallel replicas inside a server (weight updates need 1)
    enable_dp_attention: bool = False
    context_length: int | None = bounded(None, ge=1)  # None: the model's max_position_embeddings
    mem_fraction_static: float | None = bounded(None, gt=0.0, lt=1.0)  # weights + KV pool share of a GPU
    max_running_requests: int | None = bounded(None, ge=1)  # responses one server decodes at once
    max_total_tokens: int | None = bounded(None, ge=1)  # KV pool size in tokens (None: from the memory share)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8_e5m2 / fp8_e4m3 halve the pool's bytes
    disable_cuda_graph: bool = False
    # None: as the placement needs it (on for a colocated GPU run, where servers release memory to the trainer)
    enable_memory_saver: bool | None = None
    extra: dict[str, Any] = bounded(factory=dict)  # any other ServerArgs key, passed through

    PASS_THROUGH: ClassVar[str] = "extra"  # `sections.build` puts keys that are not fields here

    @property
    def gpus(self) -> int:
        """GPUs one server takes."""
        return self.tp_size * self.pp_size

    def args(self) -> dict[str, Any]:
        """The keyword arguments for SGLang's engine: every typed key set away from its default, then `extra`."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name != "extra" and getattr(self, f.name) != _default(f)}
        return {**out, **self.extra}

    def check(self, prefix: str = "servers.engine_args") -> None:
        check_bounds(self, prefix)
        typed = [f.name for f in fields(self) if f.name != "extra"]
        for key in self.extra:
            if key in typed:
                raise ConfigError(f"{prefix}.extra.{key}: a typed key; set {prefix}.{key}")
            close = difflib.get_close_matches(key, typed, n=1, cutoff=0.9)  # not ep_size for tp_size
            if close:
                raise ConfigError(f"{prefix}.{key}: not a key the project reads (did you mean {close[0]!r}?); "
                                  "other SGLang ServerArgs keys pass through, so check the spelling")


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


@dataclass
class ServersConfig:
    """The SGLang rollout servers (the run config's `servers` section)."""

    count: int = bounded(1, ge=1)  # servers `rollverify train` launches (ignored with endpoints)
    endpoints: list[str] = bounded(factory=list)  # connect to running servers instead of launching
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    # A server that does not answer for this long is lost: its unfinished responses go to the others. Servers
    # `rollverify train` launched are also watched by process, and restarted when they exit.
    timeout_s: float = bounded(300.0, gt=0.0)
    # A server `rollverify train` launches that does not serve within this long is stopped (its log's last lines
    # in the error): a cold start of an 8B model with CUDA graph capture on a busy node takes many minutes
    startup_s: float = bounded(1800.0, gt=0.0)

    def check(self) -> None:
        """The rules between this section's keys; `ConfigError` naming the key."""
        check_bounds(self, "servers")
        self.engine_args.check()

    @property
    def launched(self) -> int:
        """Servers the run launches itself (0 with endpoints: someone else runs them)."""
        return 0 if self.endpoints else self.count

    @property
    def total(self) -> int:
        """Servers the run generates on."""
        return len(self.endpoints) or self.count
