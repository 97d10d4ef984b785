"""Export and evaluation end to end: a real SGLang server serves an HF export, `rollverify train` writes
DIR/hf/step_N and per-set eval metrics, `rollverify export` rebuilds the same folder from the checkpoint,
`rollverify eval` scores it (avg@k, pass@k per set). One server for the module; bad input stops first."""

from __future__ import annotations

import json

import pytest
import torch
from engine_fixtures import SMALL_RUN

from rollverify.app.cli import main as cli_main
from rollverify.app.config import load_config
from rollverify.app.start import resolve_model
from rollverify.app.train import train
from rollverify.tasks import get_task

pytestmark = [pytest.mark.engine, pytest.mark.megatron, pytest.mark.slow]  # ~55 s idle: the slow tier


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def served_export(tmp_path_factory):
    """An HF export of the initial policy (MegatronTrainer -> export_trainer), served by `rollverify serve`."""
    from rollverify.app.export import export_trainer
    from rollverify.app.start import start_trainer
    from sglang_ext import cpu_compat
    from sglang_ext.launch import launch_server

    cfg = load_config(None, SMALL_RUN)
    model = resolve_model(cfg)
    out = tmp_path_factory.mktemp("export") / "init"
    trainer = start_trainer(cfg, model)
    try:
        export_trainer(trainer, model, out)
    finally:
        trainer.close()
    cpu_compat.activate()
    with launch_server(out, engine_args=cfg.servers.engine_args.args()) as sp:
        yield out, sp


def test_train_export_and_eval(served_export, tmp_path):
    from transformers import AutoModelForCausalLM

    _, server = served_export  # serving the export is the check that `rollverify serve` loads one
    ex = get_task("countdown").examples("eval", 3, seed=0)
    sets = {"cd": tmp_path / "cd.jsonl", "cd2": tmp_path / "cd2.jsonl"}
    for i, p in enumerate(sets.values()):
        p.write_text("".join(json.dumps({"prompt": x.prompt, "label": x.label}) + "\n" for x in ex[i:]))
    sets_arg = "eval.sets={" + ", ".join(f"{k}: {v}" for k, v in sets.items()) + "}"
    endpoint = f'servers.endpoints=["{server.endpoint}"]'
    cfg = load_config(None, [*SMALL_RUN, endpoint, "trainer.steps=2", "eval.every=2", "eval.n_samples=2", sets_arg,
                             "log.export_every=1", "log.checkpoint_every=2"])
    run = tmp_path / "run"
    train(cfg, run, progress=False)

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    for name in sets:
        assert 0.0 <= last[f"eval/{name}/avg@2"] <= last[f"eval/{name}/pass@2"] <= 1.0
    assert last["eval_reward"] == pytest.approx((last["eval/cd/avg@2"] + last["eval/cd2/avg@2"]) / 2)
    assert rows[0]["eval/cd/avg@2"] is None and rows[0]["eval_reward"] is None  # evaluated at step 2 only
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_1", "step_2"]
    step2 = _tensors(run / "hf" / "step_2")
    assert _tensors(run / "hf" / "step_1").keys() == step2.keys()
    hf = AutoModelForCausalLM.from_pretrained(run / "hf" / "step_2", dtype=torch.float32)
    assert torch.equal(hf.state_dict()["model.norm.weight"], step2["model.norm.weight"])

    # rollverify export rebuilds the same weights from the checkpoint (a fresh trainer of the same layout)
    rebuilt = tmp_path / "rebuilt"
    assert cli_main(["export", "--checkpoint", str(run), "--out", str(rebuilt)]) == 0
    again = _tensors(rebuilt)
    assert again.keys() == step2.keys() and all(torch.equal(again[k], step2[k]) for k in step2)

    # rollverify eval on the export: the server gets its weights, every set is scored k times per prompt
    res = tmp_path / "eval.json"
    rc = cli_main(["eval", "--model", str(rebuilt), "--config", "tiny_cpu", endpoint, sets_arg,
                   "eval.n_samples=2", "rollout.max_new_tokens=48", "--out", str(res)])
    assert rc == 0
    got = json.loads(res.read_text())
    assert got["model"] == str(rebuilt) and got["n_samples"] == 2
    assert {k for k in got if k.startswith("eval/")} == {f"eval/{n}/{s}@2" for n in sets for s in ("avg", "pass")}
    # a second run never overwrites the results
    assert cli_main(["eval", "--model", str(rebuilt), "--config", "tiny_cpu", "--out", str(res)]) == 2
    assert json.loads(res.read_text()) == got


def test_bad_input_stops_before_work(tmp_path, capsys):
    # export: no checkpoint, or an --out that holds files
    assert cli_main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint/trainer/rollverify_trainer.json" in capsys.readouterr().err
    (tmp_path / "checkpoint" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoint" / "trainer" / "rollverify_trainer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert cli_main(["export", "--checkpoint", str(tmp_path), "--out", str(full)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (full / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "x").exists()
    # eval: a model folder that is not there, an unknown eval key, a bad reward spec
    assert cli_main(["eval", "--model", str(tmp_path / "nope"), "--config", "tiny_cpu"]) == 2
    assert "model.path" in capsys.readouterr().err
    assert cli_main(["eval", "--model", str(full), "--config", "tiny_cpu", "eval.n_sample=2"]) == 2
    assert "eval.n_sample" in capsys.readouterr().err
    assert cli_main(["eval", "--model", str(full), "--config", "tiny_cpu", "task.reward=no_such_module:f"]) == 2
    assert "task.reward: 'no_such_module:f': cannot import module" in capsys.readouterr().err
