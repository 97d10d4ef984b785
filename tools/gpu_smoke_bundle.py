"""Build the folder tools/gpu_smoke.py needs on a bare GPU machine: `make gpu-smoke-bundle`.

    python tools/gpu_smoke_bundle.py --out build/gpu-smoke          # then, on the GPU machine, from the checkout:
    python tools/gpu_smoke.py --bundle build/gpu-smoke --json gpu_smoke.json

The GPU machine the smoke check runs on has Python 3.12, torch, transformers and nothing of this project's other
dependencies (no megatron-core, no SGLang, no network) and takes at most 64 MiB of files with the checkout. The
folder holds, within `--max-mib` (60):

    site/megatron/...        megatron-core's source tree from this venv (pure Python: it imports under any
                             Python >= 3.10; its one compiled helper, for datasets, is left out)
    site/psutil/...          what megatron-core's checkpoint writer needs that torch and transformers do not bring
                             (its writer processes die without it and the save waits for them forever; found by
                             the dry run); its compiled part is abi3, so it loads under Python 3.12 too
    cache/models/...         the tiny dense and MoE models gpu_smoke compares against transformers (made here,
                             offline, from their seeds; the 0.6B-shaped model is made on the device: 1.2 GB)
    plan_figures.json        the planner's figures part G compares with (`gpu_checks.plan_figures`)
    manifest.json            what is in it, its size, and where it came from

Nothing is installed on the GPU machine: gpu_smoke puts `site/` first on its import path and copies the models
into its work folder. `python tools/gpu_smoke.py --bundle DIR --dry-run` checks here, on CPU, that every module
the checks import resolves as it will there (megatron from the bundle, nothing outside torch and transformers).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

MAX_MIB = 60
SKIP = ("__pycache__", "*.pyc", "*.so", "*.cpp", "*.h")  # compiled for this Python only, or not Python
EXTRA = ("psutil",)  # megatron-core's needs beyond torch and transformers; each must be pure Python or abi3


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build(out: Path, max_mib: float = MAX_MIB) -> dict:
    """Write the bundle at `out` (replaced); its manifest. Raises SystemExit when it exceeds `max_mib`."""
    import gpu_checks
    import gpu_smoke
    import megatron.core

    from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model

    if out.exists():
        shutil.rmtree(out)
    (out / "site").mkdir(parents=True)
    source = Path(megatron.core.__file__).resolve().parents[1]  # .../site-packages/megatron
    shutil.copytree(source, out / "site" / "megatron", ignore=shutil.ignore_patterns(*SKIP))
    for name in EXTRA:
        package = Path(__import__(name).__file__).resolve().parent
        foreign = [p.name for p in package.rglob("*.so") if ".abi3." not in p.name]
        if foreign:
            raise SystemExit(f"error: {name} has extension modules for this Python only ({foreign}): it cannot "
                             "load under the GPU machine's Python")
        shutil.copytree(package, out / "site" / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    saved = os.environ.get("ROLLVERIFY_CACHE")
    os.environ["ROLLVERIFY_CACHE"] = str(out / "cache")
    try:
        specs = gpu_smoke.model_specs(quick=False)
        models = {name: ensure_tiny_model(TinyModelSpec(**specs[name])).name for name in gpu_smoke.BUNDLED_MODELS}
    finally:
        if saved is None:
            os.environ.pop("ROLLVERIFY_CACHE", None)
        else:
            os.environ["ROLLVERIFY_CACHE"] = saved
    for lock in (out / "cache" / "models").glob(".*.lock"):
        lock.unlink()
    (out / "plan_figures.json").write_text(json.dumps(gpu_checks.plan_figures(), indent=1) + "\n")
    parts = {"site/megatron": _size(out / "site" / "megatron"),
             **{f"site/{n}": _size(out / "site" / n) for n in EXTRA}, "cache/models": _size(out / "cache"),
             "plan_figures.json": (out / "plan_figures.json").stat().st_size}
    manifest = {
        "megatron_core": importlib.metadata.version("megatron-core"),
        "megatron_source": str(source),
        "built_with_python": platform.python_version(),
        "models": models,
        "bytes": parts,
        "total_bytes": sum(parts.values()),
        "max_bytes": int(max_mib * (1 << 20)),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["total_bytes"] = _size(out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest["total_bytes"] > manifest["max_bytes"]:
        raise SystemExit(f"error: the bundle at {out} is {manifest['total_bytes'] / 2**20:.1f} MiB, over the "
                         f"{max_mib:g} MiB a GPU machine takes with the checkout")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-smoke")
    p.add_argument("--max-mib", type=float, default=MAX_MIB)
    a = p.parse_args(argv)
    m = build(a.out, a.max_mib)
    rows = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m["bytes"].items())
    print(f"[gpu-smoke-bundle] {a.out}: {m['total_bytes'] / 2**20:.1f} MiB of {a.max_mib:g} ({rows}); megatron-core "
          f"{m['megatron_core']}; models {', '.join(m['models'])}")
    print(f"[gpu-smoke-bundle] on the GPU machine: python tools/gpu_smoke.py --bundle {a.out} --json gpu_smoke.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
