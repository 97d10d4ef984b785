"""The driver's side of a run, which both schedules drive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollverify.sections import ConfigError, bounded


@dataclass
class RolloutConfig:
    """The rollout section: the loop's GRPO batch shape, sampling, concurrency and polling, and the servers the
    application starts for it (`n_servers`, `endpoints`, `engine_args`, `server_timeout_s`, `server_startup_s`)."""

    n_servers: int = bounded(1, ge=1)  # servers launched by `rollverify train` (ignored with endpoints)
    endpoints: list[str] = bounded(factory=list)  # connect to running servers instead of launching
    batch_groups: int = bounded(8, ge=1)  # B: finished groups per optimizer step
    n: int = bounded(4, ge=2)  # responses per prompt (GRPO group size)
    max_new_tokens: int = bounded(256, ge=1)
    temperature: float = bounded(1.0, gt=0.0)
    # Responses generated at once over all servers. Above B*n it over-provisions: extra groups run while the
    # slow tail finishes, which is where partial rollout gains its speed.
    max_live: int = bounded(64, ge=1)
    engine_args: dict[str, Any] = bounded(
        factory=dict
    )  # SGLang ServerArgs, e.g. {tp_size: 4, max_total_tokens: 8192}
    # A server that does not answer for this long is lost: its unfinished responses go to the others. Servers
    # `rollverify train` launched are also watched by process, and restarted when they exit.
    server_timeout_s: float = bounded(300.0, gt=0.0)
    # A server `rollverify train` launches that does not serve within this long is stopped (its log's last lines
    # in the error): a cold start of an 8B model with CUDA graph capture on a busy node takes many minutes
    server_startup_s: float = bounded(1800.0, gt=0.0)
    wait_s: float = bounded(0.05, ge=0.0)  # how long one poll for finished responses blocks
    phase_timeout_s: float = bounded(600.0, gt=0.0)  # a rollout phase that makes no progress this long is an error

    def check(self) -> None:
        """The rules between this section's keys; `ConfigError` naming the key."""
        if self.max_live < self.n:
            raise ConfigError(
                f"rollout.max_live: must be >= rollout.n ({self.n}) so one group fits, got {self.max_live}"
            )
