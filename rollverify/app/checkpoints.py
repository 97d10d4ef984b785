"""A run folder's checkpoints: written whole or not at all, so `--resume` only ever reads a complete one.

Each checkpoint is a folder DIR/checkpoints/step_NNNNNN (the trainer's distributed checkpoint, the buffer, and
loop.json written last); DIR/checkpoint is a relative symbolic link to the last complete one. A new checkpoint
becomes the current one by an atomic rename of a new link over the old (after its files are flushed to disk),
then the older folders are removed. A save that fails (disk full, permission lost, a rank's write error) removes
what it wrote and raises `CheckpointError`: the link still names the previous checkpoint, untouched and loadable.
A driver killed while saving leaves a folder no link names; `clean` removes it when the run resumes.

Every trainer rank writes its shards into the checkpoint folder, so DIR must be storage every node shares (the Ray
launcher checks it at start, rollverify.app.cluster). Pruning removes the old folders here and, through
`remove_elsewhere` (the Ray launcher's `RayCluster.remove_on_every_node`), on every node of the run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollverify.app.rundir import CHECKPOINT
from rollverify.app.rundir import CHECKPOINTS as STORE  # DIR/checkpoints/step_NNNNNN: the checkpoint folders

LOOP_FILE = "loop.json"  # written last: a checkpoint folder without it is incomplete
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one (`kept`, None if there is none) is still current."""

    def __init__(self, step: int, kept: int | None, reason: str) -> None:
        self.step, self.kept, self.reason = step, kept, reason
        had = f"the checkpoint of step {kept} is kept" if kept is not None else "there is no earlier checkpoint"
        super().__init__(f"the checkpoint of step {step} could not be written ({reason}); {had}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


class CheckpointStore:
    """The checkpoints of run folder `out` (see the module docstring)."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.link = self.out / CHECKPOINT
        self.store = self.out / STORE
        # removes folders on every node of the run as well (None: this machine is the run's only one)
        self.remove_elsewhere: Callable[[list[Path]], None] | None = None

    def current(self) -> Path | None:
        """The folder of the last complete checkpoint, None if there is none."""
        return self.link if (self.link / LOOP_FILE).is_file() else None

    def current_step(self) -> int | None:
        d = self.current()
        if d is None:
            return None
        try:
            return int(json.loads((d / LOOP_FILE).read_text())["step"])
        except (ValueError, KeyError, TypeError, OSError):
            return None

    def save(self, step: int, write: Callable[[Path], None], state: dict[str, Any]) -> Path:
        """A checkpoint of `step`: `write(folder)` writes its parts, then `state` goes to loop.json, the files
        are flushed and the checkpoint becomes current. Raises `CheckpointError` (nothing of it left behind,
        the previous checkpoint current) when any of that fails with an OSError or `write` raises one of the
        exceptions `write_errors` lists; other exceptions (a dead trainer rank) propagate after the cleanup."""
        from megatron_bridge.proxy import RankFailure

        kept = self.current_step()
        d = self.store / f"step_{step:06d}"
        if kept is not None and self.link.resolve() == d.resolve():
            return d  # this step is the current checkpoint already
        try:
            if d.exists():
                shutil.rmtree(d)  # an incomplete folder of an earlier attempt at this step
            d.mkdir(parents=True)
            write(d)
            (d / LOOP_FILE).write_text(json.dumps(state, indent=1) + "\n")
            _fsync_tree(d)
            self._point_to(d)
        except (OSError, RankFailure) as e:
            shutil.rmtree(d, ignore_errors=True)
            if isinstance(e, RankFailure) and e.kind != "error":
                raise
            raise CheckpointError(step, kept, _reason(e)) from e
        self._remove_all_but(d)
        return d

    def _point_to(self, d: Path) -> None:
        tmp = self.out / (CHECKPOINT + ".link.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.relpath(d, self.out), tmp)
        os.replace(tmp, self.link)
        _fsync(self.out)

    def _remove_all_but(self, keep: Path) -> None:
        if not self.store.is_dir():
            return
        stale = []
        for entry in self.store.iterdir():  # only what this store writes: anything else there is not its own
            if entry.name.startswith("step_") and entry.is_dir() and entry.resolve() != keep.resolve():
                shutil.rmtree(entry, ignore_errors=True)
                stale.append(entry)
        if stale and self.remove_elsewhere is not None:
            try:
                self.remove_elsewhere(stale)
            except Exception as e:  # noqa: BLE001 - the new checkpoint is current; old shards only take space
                log.warning("old checkpoints not removed on every node: %s", e)

    def clean(self) -> None:
        """Remove what a save that never finished left (folders the link does not name, a stray link file)."""
        (self.out / (CHECKPOINT + ".link.tmp")).unlink(missing_ok=True)
        cur = self.current()
        if cur is not None:
            self._remove_all_but(cur.resolve())


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError):
        return f"{e.strerror or e} ({e.filename})" if e.filename else str(e)
    lines = [ln for ln in str(e).splitlines() if "Error" in ln]  # a rank's traceback: its last error line
    return lines[-1].strip() if lines else str(e).splitlines()[0]
