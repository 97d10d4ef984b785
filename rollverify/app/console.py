"""What a run prints: a line per start-up stage with its time, a line per step where stdout is not a terminal
(a progress bar where it is), figures with `-` where they do not apply, and filters for the CPU path's known
harmless warnings.

Lines go to stdout with the `[rollverify]` prefix and are flushed at once, so a log file follows the run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

PREFIX = "[rollverify]"


def say(message: str, file: TextIO | None = None) -> None:
    print(f"{PREFIX} {message}", file=file or sys.stdout, flush=True)


def fmt(value: Any, spec: str = ".3g") -> str:
    """A figure for a table or a log line: `-` where there is none (None, NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return format(value, spec)


@dataclass
class Stage:
    """What a stage reports when it ends (`detail`); the time is measured by `stage`."""

    name: str
    detail: str = "done"


@contextlib.contextmanager
def stage(name: str, file: TextIO | None = None) -> Iterator[Stage]:
    """Time a start-up stage and print `[rollverify] NAME: DETAIL (T s)` when it ends (nothing if it fails: the
    error says what went wrong)."""
    st = Stage(name)
    t0 = time.perf_counter()
    yield st
    say(f"{st.name}: {st.detail} ({time.perf_counter() - t0:.1f} s)", file)


STEP_KEYS = (  # (record key, label) of a step line
    ("mode", "mode"),
    ("reward_mean", "reward"),
    ("eval_reward", "eval"),
    ("ops_mean", "ops"),
    ("acceptance_rate", "accept"),
    ("n_carried", "carried"),
    ("step_s", "step_s"),
)


def step_line(metrics: Mapping[str, Any], total: int) -> str:
    """`step 3/40 mode=rollverify reward=0.41 eval=- ops=0.0061 accept=0.83 carried=12 step_s=4.2`"""
    parts = [f"step {metrics.get('step')}/{total}"]
    parts += [f"{label}={fmt(metrics.get(key))}" for key, label in STEP_KEYS]
    return " ".join(parts)


class Progress:
    """Per-step feedback: a tqdm bar when stdout is a terminal, else one plain line per step."""

    def __init__(self, total: int, start: int = 0, *, bar: bool | None = None, file: TextIO | None = None) -> None:
        self.total, self.file = total, file or sys.stdout
        self.bar = None
        if bar is None:
            bar = self.file.isatty()
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="rollverify", unit="step", dynamic_ncols=True)

    def update(self, metrics: Mapping[str, Any]) -> None:
        if self.bar is None:
            say(step_line(metrics, self.total), self.file)
            return
        self.bar.update(1)
        self.bar.set_postfix({label: fmt(metrics.get(key)) for key, label in STEP_KEYS if key != "n_carried"})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- known harmless warnings of the CPU path ------------------------------------------------------------------
# Each entry names the module that emits it and its message; anything else still shows. On a GPU none of them is
# filtered (a missing Transformer Engine matters there).
# (category, message regex, module regex)
CPU_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # Megatron-Core without Transformer Engine / Apex (neither exists for CPU) uses its torch fallbacks
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron"),
    (UserWarning, r"Apex is not installed", r"megatron"),
    # Megatron-Core's own default cuda_graph_scope; CUDA graphs are never captured on CPU
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    # Megatron's optimizer probes `.grad` of the CPU path's parameter views
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"megatron\.core\.optimizer"),
    # Megatron-Core 0.16 calls these gloo/NCCL collectives by their old names
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger",
    ),
)
# (logger name, message start) of log records that say the same kind of thing
CPU_LOG_LINES: tuple[tuple[str, str], ...] = (("torch.utils.cpp_extension", "No CUDA runtime is found"),)


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


def quiet_cpu_warnings(cpu: bool | None = None) -> None:
    """Drop the known harmless warnings of the CPU path (listed above, by module and message), nothing else.
    `cpu`: whether this is the CPU path (default: no CUDA device)."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    if not cpu:
        return
    for category, message, module in CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    by_logger: dict[str, list[str]] = {}
    for name, start in CPU_LOG_LINES:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(tuple(starts)))
