"""Shared fixtures and the suite's tiers.

Fixtures: one cached copy of each tiny model (`rollverify.app.tiny_model.cache_root()`: $ROLLVERIFY_CACHE, else the
user's cache folder) for every test session and the demo; it is made once, on first use.

Tiers (the Makefile's targets; markers in pyproject.toml):
- `make test-fast`: the pure-logic tests, `-m "not engine and not megatron and not system and not slow"`, with
  ROLLVERIFY_TEST_TIER=fast: a test there that imports SGLang's runtime or Megatron-Core, or starts a server,
  fails and names the marker it lacks (so the markers stay true);
- `make test`: all but `slow`; `make test-slow`: `slow` but the chaos run; `make chaos`: the 60-step chaos run.
`--durations-file PATH` writes the run's 30 slowest tests there, with what ran and on what load, when the run
covered its whole tier (no `-k`, no paths given): `make test` keeps docs/test-durations.txt current.
"""

from __future__ import annotations

import datetime
import importlib.abc
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

SLOWEST = 30
# module prefixes a pure-logic test must not import, and the marker a test that needs them carries
HEAVY = {"sglang.srt": "engine", "megatron.core": "megatron"}
STARTED = pytest.StashKey[tuple[float, float]]()  # the session's start: (time, load average)


@pytest.fixture(scope="session")
def tiny_dense_path():
    return ensure_tiny_model(TinyModelSpec())


@pytest.fixture(scope="session")
def tiny_moe_path():
    return ensure_tiny_model(TinyModelSpec(moe=True))


# --- the fast tier's guard ----------------------------------------------------------------------------------


class _RefuseHeavy(importlib.abc.MetaPathFinder):
    """In the fast tier: importing SGLang's runtime or Megatron-Core fails, naming the marker the test lacks."""

    def find_spec(self, name, path=None, target=None):
        for prefix, mark in HEAVY.items():
            if name == prefix or name.startswith(prefix + "."):
                raise ImportError(f"{name} imported in `make test-fast` (pure logic): mark the test "
                                  f"`pytest.mark.{mark}` (or `system` if it starts other real processes)")
        return None


def pytest_configure(config):
    if os.environ.get("ROLLVERIFY_TEST_TIER") == "fast":
        loaded = [m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in HEAVY)]
        assert not loaded, f"the fast tier started with {loaded} imported"
        sys.meta_path.insert(0, _RefuseHeavy())
        import sglang_ext.launch

        def refuse(*args, **kwargs):
            raise RuntimeError("a server started in `make test-fast` (pure logic): mark the test `pytest.mark.engine`")

        sglang_ext.launch.launch_server = refuse
    config.stash[STARTED] = (time.time(), os.getloadavg()[0])


# --- order ----------------------------------------------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """Tests marked `session_end` stop the session's shared servers: they run after every other test, so that
    no later module pays for starting them again."""
    items.sort(key=lambda item: item.get_closest_marker("session_end") is not None)  # stable: order kept otherwise


# --- durations kept --------------------------------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help=f"write the {SLOWEST} slowest tests (setup + call + teardown) to PATH when the run "
                          "covered its whole tier")


_times: dict[str, float] = defaultdict(float)
_outcomes: dict[str, int] = defaultdict(int)


def pytest_runtest_logreport(report):
    _times[report.nodeid] += report.duration
    if report.when == "call":
        _outcomes[report.outcome] += 1
    elif report.failed:
        _outcomes["error"] += 1
    elif report.skipped:
        _outcomes["skipped"] += 1


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    path = config.getoption("--durations-file")
    if not path:
        return
    whole = not config.option.keyword and all(
        Path(a).resolve() == (config.rootpath / t).resolve() for a in config.args for t in config.getini("testpaths"))
    if not whole:
        print(f"\n--durations-file: not written ({' '.join(config.args)} -k {config.option.keyword!r} is not the "
              "whole tier)")
        return
    t0, load0 = config.stash[STARTED]
    wall = time.time() - t0
    counts = ", ".join(f"{n} {k}" for k, n in sorted(_outcomes.items()))
    lines = [
        f"# The {SLOWEST} slowest tests of the last whole run of this tier (setup + call + teardown, seconds).",
        "# Written by the suite itself (tests/conftest.py, --durations-file); a later whole run replaces it.",
        f"# when: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"# tier: pytest -m {config.option.markexpr!r}",
        f"# result: {counts}; exit status {int(exitstatus)}",
        f"# wall: {wall:.0f} s ({wall / 60:.1f} min) on {os.cpu_count()} cores ({platform.machine()}), load average "
        f"{load0:.1f} at the start and {os.getloadavg()[0]:.1f} at the end",
        "",
    ]
    slowest = sorted(_times.items(), key=lambda kv: -kv[1])[:SLOWEST]
    lines += [f"{seconds:8.1f}  {nodeid}" for nodeid, seconds in slowest]
    Path(path).write_text("\n".join(lines) + "\n")
