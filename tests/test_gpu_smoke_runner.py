"""tools/gpu_smoke.py's runner on its own (no GPU, no model): the budget checked before each check, the JSON
written after every check, and the bundle's megatron-core put first on the import path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_smoke  # noqa: E402


def test_a_check_that_would_pass_the_budget_is_skipped_and_the_report_follows_every_check(tmp_path):
    report = tmp_path / "smoke.json"
    smoke = gpu_smoke.Smoke(100.0, json_path=str(report), info={"device": "cpu"})
    seen = []

    def first():
        seen.append(json.loads(report.read_text()) if report.exists() else None)
        return gpu_smoke.Check("", True, "ok", 1.0)

    smoke.run("first", first, estimate_s=10)
    assert [c["name"] for c in json.loads(report.read_text())["checks"]] == ["first"]  # written right after it
    smoke.run("too_long", lambda: gpu_smoke.Check("", True, "never runs"), estimate_s=500)
    smoke.run("raises", lambda: 1 / 0, estimate_s=1)
    got = json.loads(report.read_text())
    assert [(c["name"], c["passed"]) for c in got["checks"]] == [("first", True), ("too_long", None), ("raises", False)]
    assert got["checks"][1]["figure"].startswith("time budget: ") and "may take 500 s" in got["checks"][1]["figure"]
    assert "ZeroDivisionError" in got["checks"][2]["figure"] and got["info"]["complete"] is False
    smoke.write(complete=True)
    assert json.loads(report.read_text())["info"]["complete"] is True
    assert gpu_smoke.BUDGET_S <= 480  # one call on the GPU machine is 600 s, start and transfers included


def test_the_bundle_puts_its_megatron_first_and_its_models_in_the_work_folder(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    (bundle / "site" / "megatron" / "core").mkdir(parents=True)
    (bundle / "cache" / "models" / "qwen3-base-abc").mkdir(parents=True)
    (bundle / "cache" / "models" / "qwen3-base-abc" / "config.json").write_text("{}")
    (bundle / "plan_figures.json").write_text("{}")
    monkeypatch.setattr(sys, "path", list(sys.path))
    env = gpu_smoke.Env("cpu", True, tmp_path / "work")
    gpu_smoke.use_bundle(bundle, env)
    assert sys.path[0] == str(bundle / "site")
    assert (tmp_path / "work" / "cache" / "models" / "qwen3-base-abc" / "config.json").is_file()
    assert env.plan_figures == str(bundle / "plan_figures.json")
