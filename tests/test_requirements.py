"""The CPU and GPU install paths pin the same versions of every package they share."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)")


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"requirements/{name}: '{line}' is not an exact pin (name==version)"
        key = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert key not in pins, f"requirements/{name} pins {key} twice"
        pins[key] = m.group(2)
    return pins


def test_shared_packages_have_the_same_versions():
    cpu = {**_pins("cpu.txt"), **_pins("sglang.txt")}
    gpu = _pins("gpu.txt")
    shared = set(cpu) & set(gpu)
    assert {"torch", "sglang", "megatron-core", "transformers", "tokenizers", "pyzmq"} <= shared
    mismatched = {k: (cpu[k], gpu[k]) for k in shared if cpu[k] != gpu[k]}
    assert not mismatched, f"cpu and gpu paths disagree: {mismatched}"


def test_pins_follow_sglang_where_it_pins():
    cpu = _pins("cpu.txt")
    assert cpu["torch"] == "2.14.1" and cpu["transformers"] == "5.19.0" and cpu["tokenizers"] == "0.23.2"
    assert _pins("sglang.txt") == {"sglang": "0.5.23"}
    assert cpu["megatron-core"] == "0.16.1"


def test_installed_versions_match_the_cpu_pins():
    from importlib.metadata import version

    for pkg in ("torch", "megatron-core", "transformers", "tokenizers", "sglang", "pyzmq"):
        want = {**_pins("cpu.txt"), **_pins("sglang.txt")}[pkg]
        assert version(pkg).split("+")[0] == want, f"{pkg}: installed {version(pkg)}, pinned {want}"
