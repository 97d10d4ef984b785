"""tools/gpu_checks.py (gpu_smoke's part G) off the GPU: the planner's figures it compares with (imported, or
from the file `--write-plan-figures` writes where the planner does not import), the preset shapes it reads
without importing the application, and the IPC check's plumbing over shared memory. Its GPU measurements have
not run here (no GPU on this machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import gpu_checks  # noqa: E402


def test_plan_figures_from_the_planner_or_its_file(tmp_path, monkeypatch):
    from megatron_bridge.model import ModelArch
    from rollverify.app import plan
    from rollverify.app.presets import ARCH_PRESETS

    figures = gpu_checks.plan_figures()
    assert figures["process_overhead"] == plan.PROCESS_OVERHEAD
    lay = plan.TrainerLayout(tp=1, pp=1, dp=1)
    for shape in gpu_checks.SHAPES:
        assert gpu_checks.arch_of(shape) == ModelArch.from_hf_config(ARCH_PRESETS[shape])
        assert figures["layer_activation_bytes"][shape] == plan.layer_activation_bytes(gpu_checks.arch_of(shape), lay)
    path = tmp_path / "plan.json"
    gpu_checks.write_plan_figures(str(path))

    def no_planner():
        raise ImportError("No module named 'pydantic'")

    monkeypatch.setattr(gpu_checks, "plan_figures", no_planner)
    assert gpu_checks.load_plan_figures(str(path)) == figures
    assert gpu_checks.load_plan_figures(None) is None
    path.write_text(json.dumps({"process_overhead": 1}))
    with pytest.raises(ValueError, match="not a plan-figures file"):
        gpu_checks.load_plan_figures(str(path))


@pytest.mark.system  # two consumer processes
def test_ipc_payload_rebuilt_by_two_consumers_over_shared_memory():
    passed, figure, _, _ = gpu_checks.check_cuda_ipc("cpu", 1 << 20)
    assert passed, figure
