"""The package as pip installs it: dependency ranges that hold the reproducible pins, and a wheel that works
outside the checkout.

The wheel test builds the wheel from a copy of the sources, installs it with `--no-deps --no-index` into a fresh
venv and runs its `rollverify` script from a folder outside the checkout. The fresh venv sees the project venv's
site-packages through a .pth path line (that makes the heavy dependencies importable without installing them
again, and does not activate the checkout's editable install). What it proves: the wheel holds the packages, the
shipped configs and the CPU shim; its entry point, --version, config lookup by name and `make-tiny-model` work
from the installed copy; its metadata declares ranged dependencies and the cpu/gpu extras. What it does not: that
pip resolves those ranges from an index (no network here).
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(*files: str) -> dict[str, str]:
    pins = {}
    for name in files:
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            m = PIN.match(line.strip())
            if m:
                pins[_norm(m.group(1))] = m.group(2)
    return pins


def test_every_pin_lies_in_the_pyproject_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"cpu", "gpu"} <= set(extras)
    paths = {
        "cpu": ({**_pins("cpu.txt"), **_pins("sglang.txt")}, project["dependencies"] + extras["cpu"] + extras["test"]),
        "gpu": (_pins("gpu.txt"), project["dependencies"] + extras["gpu"]),
    }
    for path, (pins, wanted) in paths.items():
        for text in wanted:
            req = Requirement(text)
            assert str(req.specifier), f"{text}: give a version range"
            name = _norm(req.name)
            assert name in pins, f"{path}: {req.name} is a dependency but requirements/{path}.txt does not pin it"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{path}: requirements pin {name}=={pins[name]}, outside pyproject.toml's {req.specifier}"
            )
    assert "sglang" in {_norm(Requirement(r).name) for r in extras["gpu"]}


def _copy_sources(dst: Path) -> Path:
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("rollverify", "sglang_ext", "megatron_bridge", "configs"):
        shutil.copytree(ROOT / name, dst / name, symlinks=True, ignore=ignore)
    return dst


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    src = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(wheels), str(src)],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("rollverify-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert {"rollverify/configs/tiny_cpu.yaml", "rollverify/configs/qwen3_8b_base.yaml"} <= names
    assert "sglang_ext/cpu_compat/shim/sgl_kernel/__init__.py" in names and "megatron_bridge/trainer.py" in names
    assert {"cpu", "gpu"} <= set(meta.get_all("Provides-Extra"))
    requires = {Requirement(r).name: Requirement(r) for r in meta.get_all("Requires-Dist")}
    assert str(requires["torch"].specifier) and "sglang" in requires and "megatron-core" in requires

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    site.mkdir(parents=True, exist_ok=True)
    (site / "_project_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")  # the heavy deps, read-only
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", "--find-links",
         str(wheels), "rollverify"],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*argv: str) -> str:
        res = subprocess.run(argv, cwd=outside, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return res.stdout

    where = run(str(py), "-c", "import rollverify, rollverify.app.config as c; print(rollverify.__file__); "
                "print(c.find_config('tiny_cpu'))").split()
    assert all(Path(p).is_relative_to(venv) for p in where), where  # the installed copy, not the checkout
    cli = str(venv / "bin" / "rollverify")
    help_text = run(cli, "--help")
    assert all(name in help_text for name in ("train", "demo", "serve", "make-tiny-model"))
    assert run(cli, "--version").strip() == f"rollverify {meta['Version']}"
    model = tmp_path / "tiny"
    assert "tiny Qwen3 model" in run(cli, "make-tiny-model", "--out", str(model))
    assert {"config.json", "model.safetensors", "tokenizer.json", "rollverify_model.json"} <= {
        p.name for p in model.iterdir()
    }
