"""Hugging Face checkpoints out of training: ``DIR/hf/step_N`` during a run, `rollverify export` afterwards.

An export is a folder transformers and `rollverify serve` load as they are: config.json, the tokenizer files
(chat template included) of the checkpoint the run started from, and the policy's weights in HF naming as
safetensors shards with an index (`MegatronTrainer.export_hf_state`). It appears whole or not at all: it is
written beside its final name and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HF = "hf"
# Tokenizer files `export_hf_state` does not copy itself.
EXTRA_FILES = ("chat_template.jinja", "chat_template.json", "added_tokens.json", "tokenizer.model")


def export_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / HF / f"step_{step}"


def export_trainer(trainer: Any, model_path: str | Path, out: str | Path) -> Path:
    """Write the trainer's current policy (a MegatronTrainer, TrainerProxy or LoopTrainer) as an HF folder at `out`
    (replacing an earlier export there); `model_path` is the checkpoint the run started from."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    trainer.export_hf_state(tmp)
    for name in EXTRA_FILES:
        src = Path(model_path) / name
        if src.is_file():
            shutil.copy2(src, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def hf_weight_buckets(model_dir: str | Path, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, Any]]]:
    """The tensors of an HF folder's safetensors files in buckets of about `bucket_bytes` (engine updates)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = st.get_tensor(name)
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
    if bucket:
        yield bucket


def find_checkpoint(path: str | Path) -> Path:
    """The `checkpoint/` folder of a run directory (or that folder itself); a clear error when there is none."""
    from megatron_bridge.checkpoint import META_FILE  # the trainer wing names its checkpoint's files
    from rollverify.app.rundir import CHECKPOINT

    p = Path(path)
    ckpt = p / CHECKPOINT if (p / CHECKPOINT).is_dir() else p
    if not (ckpt / "trainer" / META_FILE).is_file():
        raise FileNotFoundError(
            f"--checkpoint {p}: no {CHECKPOINT}/trainer/{META_FILE} there; give a run directory trained "
            "with log.checkpoint_every > 0 (or its checkpoint/ folder)"
        )
    if not (ckpt.parent / "config.json").is_file():
        raise FileNotFoundError(f"--checkpoint {p}: the run's config.json is not beside {ckpt}")
    return ckpt


def check_new_folder(out: str | Path) -> Path:
    """`out` as a Path when it is new or an empty folder, else FileExistsError (an export replaces nothing)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty folder; give a new folder")
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Load a run's trainer checkpoint into a trainer of the same layout and export it to `out` (new or empty)."""
    from rollverify.app.config import RunConfig
    from rollverify.app.start import resolve_model, start_trainer

    ckpt = find_checkpoint(checkpoint)
    out = check_new_folder(out)
    cfg = RunConfig.from_dict(json.loads((ckpt.parent / "config.json").read_text()), check_task=False)
    from megatron_bridge.checkpoint import read_meta

    meta = read_meta(ckpt / "trainer")
    model_path = Path(meta["model_path"]) if Path(meta["model_path"]).is_dir() else resolve_model(cfg)
    trainer = start_trainer(cfg, model_path, world_size=int(meta["world_size"]))
    try:
        trainer.load_checkpoint(str(ckpt / "trainer"))
        if out.exists():
            out.rmdir()
        return export_trainer(trainer, model_path, out)
    finally:
        trainer.close()


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollverify export",
        description="Write a run's checkpoint as a Hugging Face model folder (transformers, rollverify serve, "
        "rollverify eval load it).",
    )
    p.add_argument("--checkpoint", required=True, help="run directory (with checkpoint/) or its checkpoint/ folder")
    p.add_argument("--out", required=True, help="new (or empty) folder for the Hugging Face model")
    a = p.parse_args(argv)
    try:
        find_checkpoint(a.checkpoint)
        check_new_folder(a.out)
    except (FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {export_checkpoint(a.checkpoint, a.out)}")
    return 0
