"""Run folders: what a run writes, and the rule that keeps an earlier run from being replaced by accident.

A folder given as `--out` must be new or empty, unless it holds a run and the user says what to do with it:
`--resume DIR` continues the run in DIR (its checkpoint, its metrics up to that step), `--overwrite` removes
that run's outputs first. A folder with files that no run wrote is never cleared: `--overwrite` refuses it and
names those files. All of this is decided before any server or trainer starts and before anything is written.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

CHECKPOINT = "checkpoint"  # the last complete checkpoint (a link into CHECKPOINTS)
CHECKPOINTS = "checkpoints"  # the checkpoint folders (rollverify.app.checkpoints)
# What `rollverify train` writes into a run folder (names or glob patterns); `--overwrite` removes exactly these.
RUN_OUTPUTS = (
    "config.json",
    "metrics.jsonl",
    "summary.json",
    CHECKPOINT,
    CHECKPOINTS,
    "faults.jsonl",
    "tensorboard",
    "plots",
    "hf",
    "wandb",
    "eval",
    "server*.log",
    "*.tmp",
)
# What `rollverify demo` writes besides one run folder per mode.
DEMO_OUTPUTS = ("demo.json", "comparison.png", "server.log", "*.tmp")
# Any one of these marks a folder as holding a run (config.json alone could be a model's).
RUN_MARKS = ("metrics.jsonl", "summary.json", CHECKPOINT)


class RunFolderError(ValueError):
    """An `--out` / `--resume` folder that cannot be used as asked; the message says what to do instead."""


def _prepared(entry: Path) -> bool:
    """An empty DIR/checkpoints made before the run (e.g. the mount point of a volume for the checkpoints): it
    does not make the folder hold anything."""
    return entry.name == CHECKPOINTS and entry.is_dir() and not any(entry.iterdir())


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def is_run(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in RUN_MARKS)


def describe_run(path: Path) -> str:
    """`a run of 12 steps (checkpoint at step 10)`, from its metrics and checkpoint."""
    steps = 0
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        steps = sum(1 for line in metrics.read_text().splitlines() if line.strip())
    text = f"a run of {steps} logged step{'s' if steps != 1 else ''}"
    loop = path / CHECKPOINT / "loop.json"
    if loop.is_file():
        try:
            text += f" (checkpoint at step {json.loads(loop.read_text())['step']})"
        except (ValueError, KeyError, TypeError):
            text += " (unreadable checkpoint)"
    return text


def _outputs_of(path: Path, demo: bool) -> tuple[list[Path], list[str]]:
    """(entries a run or demo wrote, names of everything else) of folder `path`."""
    ours, other = [], []
    for entry in sorted(path.iterdir()):
        if _matches(entry.name, RUN_OUTPUTS if not demo else DEMO_OUTPUTS):
            ours.append(entry)
        elif demo and entry.is_dir() and not entry.is_symlink() and not _outputs_of(entry, False)[1]:
            ours.append(entry)  # one mode's run folder, holding nothing but run outputs
        else:
            other.append(entry.name + ("/" if entry.is_dir() else ""))
    return ours, other


def check_resume(src: str | Path) -> Path:
    """The folder `--resume` names, if it holds a checkpoint to continue from."""
    src = Path(src)
    if not (src / CHECKPOINT / "loop.json").is_file():
        what = describe_run(src) if is_run(src) else "no run" if src.is_dir() else "does not exist"
        raise RunFolderError(
            f"--resume {src}: no {CHECKPOINT}/loop.json there ({what}); resume needs a run folder written with "
            "log.checkpoint_every > 0"
        )
    return src


def claim(
    out: str | Path, *, resume: str | Path | None = None, overwrite: bool = False, demo: bool = False
) -> Path:
    """Make sure a run (or, with `demo`, a demo of several runs) may write into `out`; with `overwrite`, remove
    the earlier run's outputs. Raises `RunFolderError` (nothing touched) when it may not."""
    out = Path(out)
    if resume is not None and overwrite:
        raise RunFolderError(
            "--resume and --overwrite exclude each other: resume continues a run, overwrite replaces it"
        )
    if resume is not None:
        check_resume(resume)
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder; choose another --out")
    if not out.is_dir() or not any(e for e in out.iterdir() if not _prepared(e)):
        return out
    if resume is not None and out.resolve() == Path(resume).resolve():
        return out  # continuing in place: records after the checkpoint's step are redone
    runs = sorted(d.name for d in out.iterdir() if is_run(d))
    ours, other = _outputs_of(out, demo)
    # a run (or demo) is there if it logged something, or if everything there is what one writes (a start that
    # failed before its first step leaves config.json and server logs)
    held = not other or ((out / "demo.json").exists() or bool(runs) if demo else is_run(out))
    if not held:
        listed = ", ".join(other[:5]) + (", ..." if len(other) > 5 else "")
        raise RunFolderError(
            f"--out {out} is not empty and holds no run ({listed}); nothing was written: choose a new or empty folder"
        )
    what = f"an earlier demo ({', '.join(runs) or 'no finished run'})" if demo else describe_run(out)
    if not overwrite:
        how = (
            "pass --overwrite to replace it"
            if demo
            else f"pass --resume {out} to continue it, --overwrite to replace it"
        )
        raise RunFolderError(f"--out {out} already holds {what}; {how}, or choose another --out")
    if other:
        raise RunFolderError(
            f"--out {out} holds {what} and also files no run wrote ({', '.join(other)}); --overwrite removes "
            "only a run's own outputs: move those files or choose another --out"
        )
    for entry in ours:
        if entry.name == CHECKPOINTS and entry.is_dir() and not entry.is_symlink():
            for child in entry.iterdir():  # the folder stays: it may be the mount point of a checkpoint volume
                _remove(child)
        else:
            _remove(entry)
    return out


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def next_free(base: str | Path) -> Path:
    """`base` if it is new or empty, else the first of `base-2`, `base-3`, ... that is."""
    base = Path(base)
    cand, i = base, 1
    while cand.exists() and (not cand.is_dir() or any(cand.iterdir())):
        i += 1
        cand = base.with_name(f"{base.name}-{i}")
    return cand
