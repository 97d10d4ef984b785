"""The command line as a user meets it: help, version, unknown commands, and bad input (a run folder that holds a
run, a missing model or data file, a mistyped option) refused with a message that names it, before any server or
trainer starts and without touching a file. Console output: stage lines, step lines, `-` for missing figures."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest

from rollverify import __version__
from rollverify.app import rundir
from rollverify.app.cli import COMMANDS, main
from rollverify.app.config import ConfigError, find_config, load_config, shipped_configs
from rollverify.app.console import Progress, fmt, stage, step_line

# ------------------------------------------------------------------------------------------------ help, version


def test_top_level_help_lists_every_command_with_its_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, cmd in COMMANDS.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(cmd.help)}$", out, re.M), name
    assert "--version" in out
    # the shipped configs as the package holds them, every one
    assert f"Shipped configs (pass the name or a YAML path): {', '.join(shipped_configs())}." in out
    assert {"tiny_cpu", "tiny_stale", "tiny_tools"} <= set(shipped_configs())
    assert main([]) == 2  # no command: the same help, on stderr, and a failure status
    assert "commands:" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rollverify {__version__}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trian"], r"unknown command 'trian' \(did you mean 'train'\?\); commands: demo, train"),
        (["frobnicate"], r"unknown command 'frobnicate'; commands:"),
        (["--verbose"], r"unknown option '--verbose'"),
    ],
)
def test_unknown_command_is_named(capsys, argv, message):
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("make-tiny-model", ["rollverify make-tiny-model", "tiny Qwen3", "--task", "--out"]),
        ("train", ["rollverify train", "run folder", "--resume", "--overwrite", "tiny_cpu", "examples:"]),
        ("demo", ["rollverify demo", "on-policy GRPO", "--overwrite", "runs/demo"]),
    ],
)
def test_command_help_is_its_own_and_for_users(capsys, command, says):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in says:
        assert text in out, text
    if command == "train":
        assert all(name in out for name in shipped_configs())
    for internal in ("Loop.run_step", "sglang_ext", "megatron_bridge", "DESIGN.md", "`rollverify` command line"):
        assert internal not in out


# ------------------------------------------------------------------------------------------------ run folders


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()
    }


def _finished_run(path: Path, steps: int = 3, checkpoint: int | None = 2) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1}) + "\n" for i in range(steps)))
    (path / "summary.json").write_text("{}\n")
    (path / "tensorboard").mkdir()
    (path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    (path / "server0.log").write_text("log\n")
    if checkpoint is not None:
        (path / "checkpoint").mkdir()
        (path / "checkpoint" / "loop.json").write_text(json.dumps({"step": checkpoint}))
    return path


def _train(*args: str) -> int:
    return main(["train", "--config", "tiny_cpu", *args, "trainer.steps=1"])


def test_train_refuses_an_out_that_holds_a_run(tmp_path, capsys):
    run = _finished_run(tmp_path / "run")
    before = _snapshot(run)
    assert _train("--out", str(run)) == 2
    err = capsys.readouterr().err
    assert f"--out {run} already holds a run of 3 logged steps (checkpoint at step 2)" in err
    assert f"pass --resume {run} to continue it, --overwrite to replace it" in err
    assert _snapshot(run) == before


def test_overwrite_never_removes_files_no_run_wrote(tmp_path, capsys):
    run = _finished_run(tmp_path / "run")
    (run / "notes.txt").write_text("mine\n")
    before = _snapshot(run)
    assert _train("--out", str(run), "--overwrite") == 2
    assert "also files no run wrote (notes.txt)" in capsys.readouterr().err
    assert _snapshot(run) == before
    # a folder with no run in it is refused with or without --overwrite
    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("x")
    for extra in ([], ["--overwrite"]):
        assert _train("--out", str(other), *extra) == 2
        assert "is not empty and holds no run (thesis.tex)" in capsys.readouterr().err
    assert (other / "thesis.tex").read_text() == "x"


def test_claim_overwrite_removes_exactly_the_runs_outputs(tmp_path):
    run = _finished_run(tmp_path / "run")
    (run / "metrics.jsonl.tmp").write_text("")
    assert rundir.claim(run, overwrite=True) == run
    assert run.is_dir() and not any(run.iterdir())
    assert rundir.claim(tmp_path / "new") == tmp_path / "new"  # new and empty folders are fine as they are
    assert not (tmp_path / "new").exists()
    with pytest.raises(rundir.RunFolderError, match="exclude each other"):
        rundir.claim(run, resume=run, overwrite=True)
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(rundir.RunFolderError, match="is a file, not a folder"):
        rundir.claim(file)


def test_resume_needs_a_checkpoint_and_a_free_out(tmp_path, capsys):
    no_ckpt = _finished_run(tmp_path / "a", checkpoint=None)
    before = _snapshot(no_ckpt)
    assert _train("--resume", str(no_ckpt)) == 2
    assert f"--resume {no_ckpt}: no checkpoint/loop.json there (a run of 3 logged steps)" in capsys.readouterr().err
    assert _train("--resume", str(tmp_path / "missing"), "--out", str(tmp_path / "x")) == 2
    assert "(does not exist)" in capsys.readouterr().err and not (tmp_path / "x").exists()
    src, dst = _finished_run(tmp_path / "src"), _finished_run(tmp_path / "dst", steps=5)
    dst_before = _snapshot(dst)
    assert _train("--resume", str(src), "--out", str(dst)) == 2  # into another run: refused
    assert f"--out {dst} already holds a run of 5 logged steps" in capsys.readouterr().err
    assert _snapshot(no_ckpt) == before and _snapshot(dst) == dst_before
    assert rundir.claim(src, resume=src) == src  # in place: allowed (records after the checkpoint are redone)


def test_demo_out_rules(tmp_path, capsys):
    from rollverify.app.demo import cli_main as demo

    earlier = tmp_path / "demo"
    _finished_run(earlier / "on_policy")
    (earlier / "demo.json").write_text("{}")
    before = _snapshot(earlier)
    assert demo(["--out", str(earlier)]) == 2
    err = capsys.readouterr().err
    assert f"--out {earlier} already holds an earlier demo (on_policy); pass --overwrite to replace it" in err
    assert _snapshot(earlier) == before
    assert rundir.next_free(earlier) == tmp_path / "demo-2"  # the default --out never replaces a demo
    (tmp_path / "demo-2").mkdir()
    assert rundir.next_free(earlier) == tmp_path / "demo-2"  # an empty folder is free
    assert rundir.claim(earlier, overwrite=True, demo=True) == earlier and not any(earlier.iterdir())


def test_demo_stale_runs_the_shipped_regime_with_the_three_modes(tmp_path, capsys, monkeypatch):
    """--stale resolves to configs/tiny_stale.yaml, on_policy / partial / rollverify and 40 steps; what it would
    run is checked before any server starts (a bad --eval-modes names the resolved modes)."""
    from rollverify.app import demo as demo_mod
    from rollverify.app.config import load_config

    seen = []
    real = demo_mod.load_config
    monkeypatch.setattr(demo_mod, "load_config", lambda c, o=(): seen.append((c, list(o))) or real(c, o))
    assert demo_mod.cli_main(["--stale", "--eval-modes", "spec_rl", "--out", str(tmp_path / "d")]) == 2
    assert "--eval-modes spec_rl: not among --modes on_policy partial rollverify" in capsys.readouterr().err
    assert demo_mod.cli_main(["--stale", "--out", str(tmp_path / "d"), "--steps", "0"]) == 2
    assert seen[-1][0] == "tiny_stale" and "trainer.steps=0" in seen[-1][1]
    cfg = load_config("tiny_stale")
    assert (cfg.trainer.lr, cfg.trainer.correction.method, cfg.rollout.max_live,
            cfg.servers.engine_args.max_running_requests) == (1e-3, "none", 256, 256)
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------------------------------- paths and options


def test_missing_model_or_data_stops_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert _train("--out", str(out), f"model.path={tmp_path / 'nowhere'}") == 2
    err = capsys.readouterr().err
    assert f"model.path: {tmp_path / 'nowhere'} does not exist; point model.path at a local Hugging Face" in err
    assert not out.exists()
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert _train("--out", str(out), f"model.path={empty}") == 2
    assert f"model.path: {empty} has no *.safetensors" in capsys.readouterr().err and not out.exists()
    from rollverify.app.demo import cli_main as demo

    assert demo(["--out", str(out), f"model.path={tmp_path / 'nowhere'}"]) == 2
    assert "model.path" in capsys.readouterr().err and not out.exists()
    cfg = load_config(None, ["task.name=math", "task.options.train_path=/no/data.parquet"], check_task=False)
    with pytest.raises(ConfigError, match=r"task\.options\.train_path: data file /no/data\.parquet does not exist"):
        cfg.check_paths()


def test_mistyped_task_option_gets_a_suggestion(tmp_path, capsys):
    assert _train("--out", str(tmp_path / "o"), "task.options.k_mx=20") == 2
    err = capsys.readouterr().err
    assert "task 'countdown' has no option 'k_mx' (did you mean 'k_max'?); its options:" in err
    assert not (tmp_path / "o").exists()


def test_shipped_configs_are_found_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert set(shipped_configs()) >= {"tiny_cpu", "qwen3_8b_base", "qwen3_30b_a3b_base"}
    assert find_config("tiny_cpu") == find_config("tiny_cpu.yaml")
    assert load_config("tiny_cpu").task.name == "countdown"
    (tmp_path / "tiny_cpu.yaml").write_text("seed: 7\n")  # a file that exists wins over the shipped name
    assert load_config("tiny_cpu.yaml").seed == 7
    with pytest.raises(FileNotFoundError, match=r"config file nope does not exist; .*shipped config: .*tiny_cpu"):
        load_config("nope")


def test_cache_folder(monkeypatch, tmp_path):
    from rollverify.app.tiny_model import cache_root

    monkeypatch.setenv("ROLLVERIFY_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("ROLLVERIFY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "rollverify"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "rollverify"


# ---------------------------------------------------------------------------------------------------- console


def test_figures_and_step_lines_show_a_dash_where_nothing_applies():
    assert [fmt(None), fmt(math.nan), fmt(0.41234), fmt(3), fmt("rollverify")] == ["-", "-", "0.412", "3", "rollverify"]
    m = {"step": 3, "mode": "on_policy", "reward_mean": 0.5, "eval_reward": None, "ops_mean": math.nan,
         "acceptance_rate": None, "n_carried": 0, "step_s": 4.25}
    assert step_line(m, 40) == "step 3/40 mode=on_policy reward=0.5 eval=- ops=- accept=- carried=0 step_s=4.25"
    buf = io.StringIO()  # not a terminal: one plain line per step, no bar
    progress = Progress(40, bar=None, file=buf)
    progress.update(m)
    progress.update({**m, "step": 4})
    progress.close()
    assert buf.getvalue().splitlines() == [
        "[rollverify] " + step_line(m, 40),
        "[rollverify] " + step_line({**m, "step": 4}, 40),
    ]


def test_stage_line_names_the_stage_and_its_time():
    buf = io.StringIO()
    with stage("server", file=buf) as st:
        st.detail = "SGLang at tcp://127.0.0.1:5555"
    assert re.fullmatch(r"\[rollverify\] server: SGLang at tcp://127\.0\.0\.1:5555 \(\d+\.\d s\)\n", buf.getvalue())


def test_demo_table_prints_a_dash_for_nan():
    from rollverify.app.demo import COLUMNS, table

    row = {key: 0.25 for _, key in COLUMNS}
    text = table({"on_policy": {**row, "ops_mean": math.nan, "acceptance_rate": math.nan}, "rollverify": row})
    assert "nan" not in text
    on_policy = text.splitlines()[2].split()
    assert on_policy[0] == "on_policy" and on_policy.count("-") == 2 and on_policy.count("0.250") == len(COLUMNS) - 2



def test_cpu_warning_filters_drop_only_the_known_ones():
    import logging
    import warnings

    from rollverify.app.console import CPU_WARNINGS, quiet_cpu_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        quiet_cpu_warnings(cpu=True)

        def warn(message, category, module):
            warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)

        warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning,
             "megatron.core.optimizer")
        warn("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.backends")
        warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning,
             "torch.distributed.c10d_logger")
        kept = [
            ("Apex is not installed", UserWarning, "mypackage.norms"),  # same text, another module
            ("loss is nan", UserWarning, "megatron.core.optimizer"),  # same module, another text
            ("`torch.distributed.all_reduce_coalesced` is deprecated", FutureWarning, "torch.distributed.c10d_logger"),
        ]
        for k in kept:
            warn(*k)
    assert [str(w.message) for w in seen] == [k[0] for k in kept]
    assert len(CPU_WARNINGS) >= 5
    record = logging.LogRecord("torch.utils.cpp_extension", logging.WARNING, "x", 1, "No CUDA runtime is found, "
                               "using CUDA_HOME='/usr/local'", None, None)
    other = logging.LogRecord("torch.utils.cpp_extension", logging.WARNING, "x", 1, "compiling ext", None, None)
    logger = logging.getLogger("torch.utils.cpp_extension")
    assert not logger.filter(record) and logger.filter(other)


def test_a_run_that_failed_to_start_can_be_overwritten(tmp_path, capsys):
    failed = tmp_path / "failed"  # what a start that failed before its first step leaves
    failed.mkdir()
    (failed / "config.json").write_text("{}")
    (failed / "server0.log").write_text("oom\n")
    assert _train("--out", str(failed)) == 2
    assert "already holds a run of 0 logged steps; pass --resume" in capsys.readouterr().err
    assert rundir.claim(failed, overwrite=True) == failed and not any(failed.iterdir())
    demo = tmp_path / "demo"  # a demo whose server did not start, and one whose first run did not log a step
    (demo / "on_policy").mkdir(parents=True)
    (demo / "server.log").write_text("timeout\n")
    (demo / "on_policy" / "config.json").write_text("{}")
    with pytest.raises(rundir.RunFolderError, match="already holds an earlier demo"):
        rundir.claim(demo, demo=True)
    assert rundir.claim(demo, overwrite=True, demo=True) == demo and not any(demo.iterdir())


def test_making_a_tiny_model_prints_its_warm_start_and_no_shard_bar(tmp_path, monkeypatch, capsys):
    from rollverify.app import warm_start
    from rollverify.app.tiny_model import TinyModelSpec, make_tiny_model

    monkeypatch.setitem(warm_start.RECIPES, "countdown_short", warm_start.WarmStartRecipe(steps=2, batch_size=4))
    make_tiny_model(tmp_path / "m", TinyModelSpec(task="countdown_short", hidden_size=32, head_dim=8))
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("[rollverify] warm start: training the tiny model on countdown_short (2 steps;")
    assert re.fullmatch(r"\[rollverify\] warm start: countdown_short, 2 steps, final loss \d+\.\d{3} \(\d+\.\d s\)",
                        lines[1])
    assert "Writing model shards" not in err + out


def test_make_tiny_model_refuses_a_task_it_cannot_warm_start_on(tmp_path, capsys):
    assert main(["make-tiny-model", "--out", str(tmp_path / "m"), "--task", "math"]) == 2
    assert "--task 'math': not a synthetic task; choose one of countdown" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_resume_without_config_reads_the_runs_own_config(tmp_path, capsys):
    run = _finished_run(tmp_path / "run")
    (run / "config.json").write_text(json.dumps({"algo": {"mdoe": "partial"}}))  # what the run wrote, broken here
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "algo.mdoe" in err and str(run / "config.json") in err
    with pytest.raises(SystemExit) as info:
        main(["train", "--out", str(tmp_path / "new")])
    assert info.value.code == 2
    assert "--config is required (with --resume it defaults to the run's config.json)" in capsys.readouterr().err


def test_config_errors_stop_before_anything_starts(tmp_path, capsys):
    rc = main(["train", "--config", "configs/tiny_cpu.yaml", "--out", str(tmp_path / "x"), "algo.mdoe=partial"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "algo.mdoe" in err
    assert not (tmp_path / "x").exists()
    rc = main(["train", "--config", "configs/tiny_cpu.yaml", "--out", str(tmp_path / "y"), "algo.mode=fast"])
    assert rc == 2 and "algo.mode" in capsys.readouterr().err
