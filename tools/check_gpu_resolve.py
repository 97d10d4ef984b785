"""Does the GPU install path resolve? Runs pip's resolver on requirements/gpu.txt as a dry run (nothing installed).

    python tools/check_gpu_resolve.py [--json runs/gpu_resolve.json]     # or: make check-gpu-resolve

The CPU path installs sglang with ``--no-deps``, so only this check ever runs SGLang's GPU dependency tree through
a resolver on a machine without a GPU. It resolves ``requirements/gpu.txt`` with ``requirements/cpu.txt`` as
constraints, so one run shows both that the GPU file is installable and that every version the CPU path pins is
one the GPU tree accepts (the two paths run the same versions of what they share). It uses its own throwaway venv
with a pinned pip (``.cache/gpu-resolve-venv``), so the answer does not depend on the pip of the machine.

Every package of the resolved set must come as a wheel for the target platform (CPython 3.11 on Linux x86_64,
this machine's: pip's resolver picks, per package, the wheel this interpreter installs and falls back to a source
distribution only where none exists). A package that would build from source fails the check, unless
`SOURCE_BUILDS` lists it with the command that builds it; those are printed. Transformer Engine's PyTorch extension
is such a build (requirements/te.txt, `make te`): it is not part of gpu.txt's resolved set, and the check only
confirms that its pinned version is published.

Exit status: 0 resolved; 1 the pins conflict, or a package has no wheel (pip's explanation, or the package, is
printed); 2 the package registry could not be reached, so nothing was checked (said as such, never a silent
pass); 3 the check itself could not run. Takes about 3-8 minutes here, most of it waiting on the registry.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import venv
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIP = "pip==26.3"  # the resolver used for the check: pinned so that its verdict is reproducible
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;#]+)")

# packages the GPU path builds from source (no wheel for the target platform), each with the command that does
SOURCE_BUILDS = {
    "transformer-engine-torch": "make te  (pip install --no-build-isolation -r requirements/te.txt, on a GPU node "
                                "with the CUDA toolkit and cuDNN, after `make setup PROFILE=gpu`)",
}
OPTIONAL_SOURCE_BUILDS = {"transformer-engine-torch": ROOT / "requirements" / "te.txt"}  # outside gpu.txt

# pip's words when it could not talk to the registry at all (as opposed to a registry that said no)
UNREACHABLE = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "No matching distribution found for pip",
)


@dataclass
class Verdict:
    status: str  # resolved | conflict | unreachable | error
    seconds: float
    n_packages: int = 0
    versions: dict[str, str] = field(default_factory=dict)  # every package of the resolved GPU install
    mismatched_pins: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (pinned, resolved)
    sources: dict[str, str] = field(default_factory=dict)  # name -> the source distribution pip would build
    source_builds: dict[str, str] = field(default_factory=dict)  # listed source builds -> their command
    detail: str = ""

    @property
    def exit_code(self) -> int:
        return {"resolved": 0, "conflict": 1, "no-wheel": 1, "unreachable": 2}.get(self.status, 3)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            out[canonical(m.group(1))] = m.group(2)
    return out


def classify(returncode: int, output: str) -> str:
    """resolved / conflict / unreachable / error from pip's exit status and its output."""
    if returncode == 0:
        return "resolved"
    if any(marker in output for marker in UNREACHABLE):
        return "unreachable"
    if "ResolutionImpossible" in output or "conflicting dependencies" in output or "No matching distribution" in output:
        return "conflict"
    return "error"


def pip_errors(output: str) -> str:
    """pip's own explanation, without the noise of index locations that do not exist on this machine."""
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("WARNING: Location")]
    return "\n".join(lines[-40:])


def resolver_python(venv_dir: Path) -> Path:
    python = venv_dir / "bin" / "python"
    stamp = venv_dir / f".{PIP}"
    if not stamp.exists():
        venv.create(venv_dir, with_pip=True, clear=True)
        r = subprocess.run(
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", PIP],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(r.stdout + r.stderr)
        stamp.touch()
    return python


def check(gpu: Path, cpu: Path, venv_dir: Path, report: Path) -> Verdict:
    t0 = time.perf_counter()
    try:
        python = resolver_python(venv_dir)
    except RuntimeError as e:
        out = str(e)
        status = "unreachable" if classify(1, out) == "unreachable" else "error"
        return Verdict(status, time.perf_counter() - t0, detail=f"could not install {PIP}:\n{pip_errors(out)}")
    cmd = [
        str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--disable-pip-version-check", "--report", str(report), "-r", str(gpu), "-c", str(cpu),
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    status = classify(r.returncode, r.stdout + r.stderr)
    if status != "resolved":
        return Verdict(status, seconds, detail=pip_errors(r.stdout + r.stderr))
    installed = json.loads(report.read_text())["install"]
    versions = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installed}
    wanted = {**pins(cpu), **pins(gpu)}
    mismatched = {k: (v, versions[k]) for k, v in wanted.items() if k in versions and versions[k] != v}
    if mismatched:  # cannot happen when pip honours the pins; checked so a silent override would show
        return Verdict("conflict", seconds, len(versions), versions, mismatched, "resolved versions differ from pins")
    sources = not_wheels(installed)
    unlisted = {k: v for k, v in sources.items() if k not in SOURCE_BUILDS}
    builds = {k: SOURCE_BUILDS[k] for k in (*sources, *OPTIONAL_SOURCE_BUILDS) if k in SOURCE_BUILDS}
    missing = [k for k in OPTIONAL_SOURCE_BUILDS if not published(python, k, pins(OPTIONAL_SOURCE_BUILDS[k]))]
    if unlisted or missing:
        detail = "".join(f"\n  {k}: no wheel for CPython 3.11 on Linux x86_64, pip would build {v}" for k, v in
                         unlisted.items()) + "".join(f"\n  {k}: its pinned version is not published" for k in missing)
        return Verdict("no-wheel", time.perf_counter() - t0, len(versions), versions, {}, sources, builds,
                       "packages without a wheel for the target platform (list them in SOURCE_BUILDS with the command "
                       "that builds them, or pin a version that has one):" + detail)
    return Verdict("resolved", time.perf_counter() - t0, len(versions), versions, {}, sources, builds)


def not_wheels(installed: list[dict]) -> dict[str, str]:
    """Of pip's report's `install` entries, those it would build from a source distribution: name -> file."""
    out = {}
    for item in installed:
        url = item.get("download_info", {}).get("url", "")
        if not url.endswith(".whl"):
            out[canonical(item["metadata"]["name"])] = url.rsplit("/", 1)[-1]
    return out


def published(python: Path, name: str, pinned: dict[str, str]) -> bool:
    """Whether the registry has the version of `name` (or of the package it is the extension of) that `pinned`
    names (pip's `index versions`)."""
    base = name.removesuffix("-torch")
    version = pinned.get(name) or pinned.get(base)
    if version is None:
        return False
    r = subprocess.run([str(python), "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                       capture_output=True, text=True)
    return r.returncode == 0 and version in re.split(r"[\s,]+", r.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", type=Path, default=ROOT / "requirements" / "gpu.txt")
    p.add_argument("--cpu", type=Path, default=ROOT / "requirements" / "cpu.txt", help="pins used as constraints")
    p.add_argument("--venv", type=Path, default=ROOT / ".cache" / "gpu-resolve-venv")
    p.add_argument("--json", type=Path, default=None, help="write the verdict (and every resolved version) here")
    a = p.parse_args(argv)
    for f in (a.gpu, a.cpu):
        if not f.is_file():
            print(f"error: {f} does not exist", file=sys.stderr)
            return 3
    a.venv.parent.mkdir(parents=True, exist_ok=True)
    v = check(a.gpu, a.cpu, a.venv, a.venv.parent / "gpu-resolve-report.json")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(asdict(v), indent=1, sort_keys=True) + "\n")
    name = a.gpu.relative_to(ROOT) if a.gpu.is_relative_to(ROOT) else a.gpu
    if v.status == "resolved":
        key = ", ".join(f"{k} {v.versions[k]}" for k in ("sglang", "torch", "numpy", "ray") if k in v.versions)
        print(f"[gpu-resolve] OK: {name} resolves to {v.n_packages} packages ({key}), each a wheel for CPython 3.11 "
              f"on Linux x86_64, in {v.seconds:.0f} s")
        for k, cmd in v.source_builds.items():
            print(f"[gpu-resolve] built from source: {k}: {cmd}")
    elif v.status == "no-wheel":
        print(f"[gpu-resolve] FAIL: {v.detail}", file=sys.stderr)
    elif v.status == "unreachable":
        print(
            f"[gpu-resolve] NOT CHECKED: the package registry could not be reached after {v.seconds:.0f} s; "
            f"whether {name} installs is unknown.\n{v.detail}",
            file=sys.stderr,
        )
    elif v.status == "conflict":
        print(f"[gpu-resolve] FAIL: {name} does not resolve ({v.seconds:.0f} s):\n{v.detail}", file=sys.stderr)
        for k, (want, got) in v.mismatched_pins.items():
            print(f"  {k}: pinned {want}, resolved {got}", file=sys.stderr)
    else:
        print(f"[gpu-resolve] ERROR: the resolver did not run:\n{v.detail}", file=sys.stderr)
    return v.exit_code


if __name__ == "__main__":
    sys.exit(main())
