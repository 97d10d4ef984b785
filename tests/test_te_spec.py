"""Transformer Engine's layer spec without TE installed: the TE class names the trainer relies on, read from the
pinned megatron-core's source, and a TE module's `_extra_state` (its FP8 metadata) through the converter and the
distributed checkpoint. The TE layers themselves run in tools/gpu_smoke.py where TE is installed."""

from __future__ import annotations

import ast
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_fixtures import fixed_sequences, tiny_path

from megatron_bridge.model import TE_PARALLEL_DIMS

pytestmark = pytest.mark.megatron


def _te_extension_source() -> ast.Module:
    spec = importlib.util.find_spec("megatron.core")
    return ast.parse((Path(spec.origin).parent / "extensions" / "transformer_engine.py").read_text())


def _parallel_modes(tree: ast.Module) -> dict[str, str]:
    """Class name -> the `parallel_mode` its constructor passes on (directly or through its base)."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}

    def mode(name: str) -> str | None:
        node = classes.get(name)
        if node is None:
            return None
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "__init__":
                for kw in call.keywords:
                    if kw.arg == "parallel_mode" and isinstance(kw.value, ast.Constant):
                        return kw.value.value
        bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
        return next((m for m in map(mode, bases) if m), None)

    return {name: mode(name) for name in classes}


def test_the_te_layers_the_trainer_names_exist_with_their_split():
    """`mark_tensor_parallel` tags TE weights by class name (TE is absent here, so the classes cannot be
    imported): every name exists in megatron-core 0.16.1 and splits the dimension it is given."""
    modes = _parallel_modes(_te_extension_source())
    for name, dim in TE_PARALLEL_DIMS.items():
        assert name in modes, f"{name} is not a class of megatron/core/extensions/transformer_engine.py"
        assert modes[name] == ("column" if dim == 0 else "row"), (name, modes[name])


class _Fp8Meta:
    """What TE's modules add to a layer: `get_extra_state` returns their FP8 scaling state serialized into a
    uint8 tensor (te.pytorch.module.base), `set_extra_state` takes it back."""

    def get_extra_state(self):
        buf = io.BytesIO()
        torch.save(getattr(self, "fp8_meta_state", {"scale": torch.ones(2), "amax_history": torch.zeros(4, 2)}), buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is None:
            return
        blob = state.numpy().tobytes() if torch.is_tensor(state) else state.getvalue()
        self.fp8_meta_state = torch.load(io.BytesIO(blob))


def _with_fp8_meta(trainer) -> list:
    """The trainer's linear layers with TE's extra state (their class swapped for a subclass that has it)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_bridge.model import unwrap

    mods = [m for m in unwrap(trainer.model).modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for m in mods:
        m.__class__ = type(f"Te{type(m).__name__}", (_Fp8Meta, type(m)), {})
    return mods


def test_extra_state_passes_the_converter_and_round_trips_the_checkpoint(tmp_path):
    from megatron_bridge.trainer import MegatronTrainer, TrainerConfig
    from rollverify.losses import CorrectionConfig

    trainer = MegatronTrainer(tiny_path(), TrainerConfig(lr=1e-2, micro_batch_tokens=24, correction=CorrectionConfig(method="none")))
    seqs = fixed_sequences(2)
    for s, a in zip(seqs, (1.0, -1.0), strict=True):
        s.advantage = a
    trainer.train_step(seqs)  # the distributed optimizer has state to save after a step
    plain = trainer.export_hf_state()
    mods = _with_fp8_meta(trainer)
    state = {k for k in trainer.model.state_dict() if k.endswith("_extra_state")}
    assert len(state) >= len(mods) > 0  # every layer now carries extra state in its state dict
    exported = trainer.export_hf_state()  # the converter reads parameters only: no _extra_state in the HF folder
    assert exported.keys() == plain.keys() and all(torch.equal(exported[k], plain[k]) for k in plain)
    for i, m in enumerate(mods):
        m.fp8_meta_state = {"scale": torch.full((2,), float(i + 2)), "amax_history": torch.arange(8.0).view(4, 2)}
    lp, _ = trainer.compute_logprobs(seqs)
    trainer.save_checkpoint(tmp_path / "ckpt")
    for m in mods:
        m.fp8_meta_state = {"scale": torch.zeros(2), "amax_history": torch.zeros(4, 2)}
    trainer.load_checkpoint(tmp_path / "ckpt")
    for i, m in enumerate(mods):  # each layer's own state came back (sharded objects keyed by layer)
        assert torch.equal(m.fp8_meta_state["scale"], torch.full((2,), float(i + 2)))
        assert torch.equal(m.fp8_meta_state["amax_history"], torch.arange(8.0).view(4, 2))
    assert np.array_equal(trainer.compute_logprobs(seqs)[0], lp)
    trainer.close()


def test_the_te_pin_is_inside_megatron_cores_declared_range():
    """requirements/te.txt pins the Transformer Engine that megatron-core 0.16.1 declares it works with (its
    metadata in this venv), not a newer one whose internals its TE extension reaches into."""
    import re
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    line = next(x.strip() for x in (Path(__file__).parents[1] / "requirements" / "te.txt").read_text().splitlines()
                if x.strip() and not x.startswith("#"))
    pinned = Requirement(line)
    (version,) = [s.version for s in pinned.specifier if s.operator == "=="]
    declared = [Requirement(r) for r in requires("megatron-core") or []
                if re.match(r"transformer[-_]engine\b", r)]
    assert declared, "megatron-core's metadata names no transformer-engine requirement"
    for req in declared:
        assert req.specifier.contains(version, prereleases=True), f"TE {version} is outside {req}"
        assert pinned.extras <= req.extras | {"pytorch", "core_cu13"}
