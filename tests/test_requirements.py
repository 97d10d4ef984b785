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
    assert {"torch", "sglang", "megatron-core", "transformers", "tokenizers", "pyzmq", "ray"} <= shared
    mismatched = {k: (cpu[k], gpu[k]) for k in shared if cpu[k] != gpu[k]}
    assert not mismatched, f"cpu and gpu paths disagree: {mismatched}"


def _sglang_exact_pins() -> dict[str, str]:
    """What the installed sglang's metadata pins exactly (name==version, outside its extras)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    exact = {}
    for line in requires("sglang") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        spec = list(req.specifier)
        if len(spec) == 1 and spec[0].operator == "==":
            exact[re.sub(r"[-_.]+", "-", req.name).lower()] = spec[0].version
    return exact


def test_pins_follow_sglang_where_it_pins():
    sglang = _sglang_exact_pins()
    assert {"torch", "transformers", "tokenizers"} <= set(sglang)  # the packages the project reaches into
    for path in ("cpu.txt", "gpu.txt"):
        pins = _pins(path)
        differ = {k: (pins[k], v) for k, v in sglang.items() if k in pins and pins[k] != v}
        assert not differ, f"requirements/{path} pins (ours, sglang's) differently: {differ}"
    assert _pins("sglang.txt")["sglang"] == _pins("gpu.txt")["sglang"]


def test_installed_versions_match_the_cpu_pins():
    from importlib.metadata import version

    for pkg in ("torch", "megatron-core", "transformers", "tokenizers", "sglang", "pyzmq"):
        want = {**_pins("cpu.txt"), **_pins("sglang.txt")}[pkg]
        assert version(pkg).split("+")[0] == want, f"{pkg}: installed {version(pkg)}, pinned {want}"


def _resolve_tool():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("check_gpu_resolve", ROOT / "tools" / "check_gpu_resolve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_gpu_resolve_check_tells_an_unreachable_registry_from_a_conflict():
    tool = _resolve_tool()
    conflict = (
        "ERROR: Cannot install numpy==2.4.6 and sglang because these package versions have conflicting "
        "dependencies.\nERROR: ResolutionImpossible: for help visit ..."
    )
    offline = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(...: Failed to "
        "establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/sglang/\n"
        "ERROR: Could not find a version that satisfies the requirement sglang==0.5.23 (from versions: none)\n"
        "ERROR: No matching distribution found for sglang==0.5.23"
    )
    assert tool.classify(0, "") == "resolved"
    assert tool.classify(1, conflict) == "conflict"
    assert tool.classify(1, offline) == "unreachable"  # not a pass, and not blamed on the pins
    assert tool.classify(1, "ERROR: No matching distribution found for sglang==9.9") == "conflict"
    assert tool.classify(1, "Traceback (most recent call last): ...") == "error"
    verdicts = {s: tool.Verdict(s, 0.0).exit_code for s in ("resolved", "conflict", "unreachable", "error")}
    assert verdicts == {"resolved": 0, "conflict": 1, "unreachable": 2, "error": 3}


def test_gpu_resolve_check_reads_the_same_pins_as_the_install():
    tool = _resolve_tool()
    assert tool.pins(ROOT / "requirements" / "gpu.txt") == _pins("gpu.txt")
    assert "WARNING: Location" not in tool.pip_errors("WARNING: Location 'file:///x' is ignored\nERROR: boom")


def test_the_gpu_path_carries_ray_and_numpy_that_sglangs_gpu_tree_accepts():
    gpu = _pins("gpu.txt")
    assert "ray" in gpu and "ray" in _pins("cpu.txt")  # the cluster launcher (its range: tests/test_packaging.py)
    # sglang 0.5.23's GPU tree (numba 0.65.1 among it) does not accept numpy 2.4.x; the resolver check in .ci/run
    # is what proves the whole set, this only keeps the known conflict from coming back unnoticed
    assert tuple(int(x) for x in gpu["numpy"].split(".")[:2]) < (2, 4)
