"""tools/check_gpu_resolve.py's wheel check: a GPU requirement that pip would build from a source distribution
fails the check unless it is one of the listed source builds, which are printed with their build command. pip's
resolver itself is scripted here (its real run takes minutes and the registry: `make check-gpu-resolve`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("check_gpu_resolve_w", ROOT / "tools" / "check_gpu_resolve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _entry(name: str, version: str, file: str) -> dict:
    return {"metadata": {"name": name, "version": version},
            "download_info": {"url": f"https://files.example/packages/{file}", "archive_info": {}}}


def test_a_package_without_a_wheel_fails_unless_it_is_a_listed_source_build(tmp_path, monkeypatch, capsys):
    tool = _tool()
    gpu, cpu = tmp_path / "gpu.txt", tmp_path / "cpu.txt"
    gpu.write_text("sglang==0.5.23\ntorch==2.14.1\n")
    cpu.write_text("torch==2.14.1\n")
    installed = [_entry("sglang", "0.5.23", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"),
                 _entry("torch", "2.14.1", "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"),
                 _entry("torch_memory_saver", "0.0.10", "torch_memory_saver-0.0.10.tar.gz")]

    class Ran:
        returncode, stdout, stderr = 0, "", ""

    def pip(cmd, **kw):
        Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps({"install": installed}))
        return Ran()

    monkeypatch.setattr(tool, "resolver_python", lambda venv: Path(sys.executable))
    monkeypatch.setattr(tool.subprocess, "run", pip)
    monkeypatch.setattr(tool, "published", lambda python, name, pinned: True)
    v = tool.check(gpu, cpu, tmp_path / "venv", tmp_path / "report.json")
    assert v.status == "no-wheel" and v.exit_code == 1
    assert "torch-memory-saver: no wheel for CPython 3.11 on Linux x86_64, pip would build " \
           "torch_memory_saver-0.0.10.tar.gz" in v.detail
    installed[-1] = _entry("transformer_engine_torch", "2.11.0", "transformer_engine_torch-2.11.0.tar.gz")
    v = tool.check(gpu, cpu, tmp_path / "venv", tmp_path / "report.json")
    assert v.status == "resolved" and v.sources == {"transformer-engine-torch": "transformer_engine_torch-2.11.0.tar.gz"}
    assert v.source_builds["transformer-engine-torch"].startswith("make te")
    monkeypatch.setattr(tool, "published", lambda python, name, pinned: False)  # te.txt's pin not on the registry
    v = tool.check(gpu, cpu, tmp_path / "venv", tmp_path / "report.json")
    assert v.status == "no-wheel" and "transformer-engine-torch: its pinned version is not published" in v.detail


def test_pins_with_extras_are_read():
    tool = _tool()
    assert tool.pins(ROOT / "requirements" / "te.txt") == {"transformer-engine": "2.11.0"}
