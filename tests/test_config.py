"""Run config: YAML + dotted overrides, typed and validated before anything starts; the shipped configs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from rollverify.app.config import ConfigError, RunConfig, load_config, parse_override
from rollverify.app.tiny_model import TinyModelSpec
from rollverify.strategies import AlgoConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_tiny_cpu_config():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml")
    assert isinstance(cfg.algo, AlgoConfig)  # the loop's own dataclass, not a copy
    assert cfg.algo.mode == "rollverify" and cfg.algo.d_s == 0.01 and cfg.algo.d_t == 2.0
    assert cfg.task.name == "countdown" and cfg.model.path is None
    assert cfg.model.task == "countdown"  # auto: warm-start on the synthetic task
    TinyModelSpec(**cfg.model.tiny_spec())
    assert cfg.rollout.max_new_tokens >= 197  # the longest correct countdown response
    assert (cfg.trainer.eps_low, cfg.trainer.eps_high, cfg.trainer.correction.tis_cap) == (0.2, 0.3, 2.0)
    assert cfg.trainer.correction.method == "tis"
    assert cfg.trainer.world_size == 1 and cfg.trainer.loss_kind == "ppo"
    # every key of the file is a real key with its documented default, except what the CPU default changes
    defaults = RunConfig.from_dict({}).to_dict()
    changed = {
        (s, k)
        for s, sec in cfg.to_dict().items()
        if isinstance(sec, dict)
        for k, v in sec.items()
        if defaults[s][k] != v
    }
    assert changed <= {
        ("rollout", "max_new_tokens"),
        ("servers", "engine_args"),
        ("servers", "startup_s"),  # a tiny model starts in seconds: fail fast
        ("trainer", "lr"),
        ("eval", "every"),
        ("eval", "n_prompts"),
        ("eval", "n_samples"),
        ("log", "checkpoint_every"),
    }, changed


def test_round_trip_through_json():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml", ["algo.d_t=inf", "servers.engine_args.chunked_prefill_size=512"])
    raw = json.loads(json.dumps(cfg.to_dict()))
    assert RunConfig.from_dict(raw).to_dict() == cfg.to_dict()


def test_the_servers_section_types_what_the_project_reads_and_passes_the_rest_through():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml", ["servers.engine_args.tp_size=2", "servers.engine_args.pp_size=2",
                                                  "servers.engine_args.chunked_prefill_size=512",
                                                  "servers.engine_args.attention_backend=torch_native"])
    ea = cfg.servers.engine_args
    assert (ea.tp_size, ea.pp_size, ea.gpus, ea.max_running_requests) == (2, 2, 4, 64)
    assert ea.extra == {"chunked_prefill_size": 512, "attention_backend": "torch_native"}
    # SGLang gets what was set: typed keys away from their defaults, then the rest as given
    assert ea.args() == {"tp_size": 2, "pp_size": 2, "max_running_requests": 64, "max_total_tokens": 32768,
                         "chunked_prefill_size": 512, "attention_backend": "torch_native"}
    assert RunConfig.from_dict({}).servers.engine_args.args() == {}
    # max_live against what the launched servers run at once: more servers make room; servers someone else runs
    # (endpoints) are sized by whoever runs them
    assert load_config(CONFIGS / "tiny_cpu.yaml", ["rollout.max_live=128", "servers.count=2"]).rollout.max_live == 128
    load_config(CONFIGS / "tiny_cpu.yaml", ["rollout.max_live=128", 'servers.endpoints=["tcp://127.0.0.1:1"]'])
    load_config(None, ["rollout.max_live=4096"])  # max_running_requests unset: SGLang sizes it


@pytest.mark.parametrize("name", ["qwen3_8b_base", "qwen3_30b_a3b_base"])
def test_paper_configs(name):
    cfg = load_config(CONFIGS / f"{name}.yaml", check_task=False)  # their data files are not here
    r, t, a, s = cfg.rollout, cfg.trainer, cfg.algo, cfg.servers
    assert (r.batch_groups, r.n) == (128, 8)
    assert r.max_new_tokens + 2048 == 32768 == s.engine_args.context_length
    assert t.lr == 1e-6 and (t.eps_low, t.eps_high, t.correction.tis_cap, t.dual_clip_c) == (0.2, 0.3, 2.0, 3.0)
    assert t.steps == 500 and t.loss == "grpo" and t.correction.method == "tis"
    assert (a.mode, a.d_s, a.d_t, a.switch_window, a.switch_tau) == ("rollverify", 0.01, 2.0, 8, 0.5)
    assert a.seq_stage and a.token_stage and a.conditional_switch
    assert cfg.model.dtype == "bfloat16" and cfg.model.path and cfg.model.task is None
    assert cfg.task.name == "math" and cfg.task.options["train_path"].endswith(".parquet")
    assert t.world_size == 32
    assert s.count * s.engine_args.tp_size == 32 and r.max_live == s.count * s.engine_args.max_running_requests
    if "a3b" in name:
        assert t.ep > 1 and t.replay_train and (t.tp * t.dp) % t.ep == 0


def test_overrides():
    cfg = load_config(
        CONFIGS / "tiny_cpu.yaml",
        [
            "algo.mode=partial",
            "algo.d_s=0.02",
            "algo.d_t=inf",
            "trainer.steps=40",
            "seed=1",
            "trainer.lr=1e-5",  # YAML 1.1 reads this as a string; the float field takes it
            "trainer.dual_clip_c=.inf",
            "servers.engine_args.max_total_tokens=1024",
            "task.options.k_max=16",
            "log.run_name=null",
            "model.tiny_overrides.hidden_size=128",
            "eval.every=0",
        ],
    )
    assert cfg.algo.mode == "partial" and cfg.algo.d_s == 0.02 and math.isinf(cfg.algo.d_t)
    assert cfg.trainer.steps == 40 and cfg.seed == 1 and cfg.trainer.lr == 1e-5
    assert math.isinf(cfg.trainer.dual_clip_c)
    assert cfg.servers.engine_args.args() == {"max_total_tokens": 1024, "max_running_requests": 64}
    assert cfg.task.options == {"k_max": 16} and cfg.log.run_name is None and cfg.eval.every == 0
    assert cfg.model.tiny_spec()["hidden_size"] == 128
    assert load_config(None).algo == AlgoConfig()  # no file: all defaults
    # a nested section: its keys one by one, the rest from the file
    c = load_config(CONFIGS / "tiny_cpu.yaml", ["trainer.correction.method=mask_offpolicy",
                                                "trainer.correction.then=icepop", "trainer.correction.icepop_low=0.3"])
    c = c.trainer.correction
    assert (c.method, c.then, c.icepop_low, c.icepop_high, c.weighting) == ("mask_offpolicy", "icepop", 0.3, 2.0, "icepop")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("x=") == (["x"], "")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trainer.lrr=1",
            r"unknown config key trainer\.lrr \(did you mean 'lr'\?\); allowed in trainer: steps, lr,",
        ),
        ("algo.dd=1", r"unknown config key algo\.dd; allowed in algo: mode, d_s, d_t"),
        (
            "trainr.lr=1",
            r"unknown config section 'trainr' \(did you mean 'trainer'\?\); allowed: model, task",
        ),
        ("rollout.n=abc", r"rollout\.n: expected an integer, got 'abc'"),
        ("trainer.steps=true", r"trainer\.steps: expected an integer, got True"),
        ("trainer.steps=2.5", r"trainer\.steps: expected an integer, got 2\.5"),
        ("trainer.lr=fast", r"trainer\.lr: expected a number \(inf allowed\), got 'fast'"),
        ("trainer.lr=nan", r"trainer\.lr: must be a number, got nan"),
        ("trainer.lr=0", r"trainer\.lr: must be > 0\.0, got 0"),
        ("trainer.eps_low=1.5", r"trainer\.eps_low: must be < 1\.0, got 1\.5"),
        ("trainer.dual_clip_c=1", r"trainer\.dual_clip_c: must be > 1\.0"),
        ("rollout.temperature=0", r"rollout\.temperature: must be > 0\.0"),
        ("rollout.n=1", r"rollout\.n: must be >= 2, got 1"),
        ("trainer.loss=ppo2", r"trainer\.loss: expected one of grpo, ppo, gspo, sapo(, \w+)*, got 'ppo2'"),
        ("trainer.lr_decay_style=step", r"trainer\.lr_decay_style: expected one of constant, linear, cosine"),
        ("model.dtype=fp8", r"model\.dtype: expected one of auto, float32, bfloat16"),
        ("algo.mode=bogus", r"algo\.mode must be one of .*on_policy.*rollverify.*got 'bogus'"),
        ("algo.switch_tau=2", r"algo\.switch_tau must be a number in \[0, 1\]"),
        ("algo.switch_estimator=median", r"algo\.switch_estimator must be one of"),
        ("algo.seq_stage=1", r"algo\.seq_stage: expected true or false, got 1"),
        ("servers.engine_args=5", r"servers\.engine_args: expected a mapping, got 5"),
        ("servers.endpoints=tcp://x", r"servers\.endpoints: expected a list"),
        ("seed=-1", r"seed: must be >= 0"),
        ("seed=x", r"seed: expected an integer"),
        ("trainer.ep=3", r"trainer\.ep: must divide tp\*dp = 1"),
        ("rollout.max_live=3", r"rollout\.max_live: must be >= rollout\.n \(4\)"),
        ("trainer.min_lr=1", r"trainer\.min_lr: must be <= trainer\.lr"),
        ("task.name=sudoku", r"task\.name: unknown task 'sudoku'; registered: .*countdown"),
        ("task.options.k_min=100", r"task\.options: .*k_min"),
        (
            "task.options.k_mx=1",
            r"task\.options: task 'countdown' has no option 'k_mx' \(did you mean 'k_max'\?\); its options: .*stride_max",
        ),
        ("task.options.colour=1", r"task\.options: task 'countdown' has no option 'colour'; its options:"),
        ("model.task=math", r"model\.task: 'math' is not a synthetic task"),
        (
            "model.tiny_overrides.hidden=1",
            r"model\.tiny_overrides\.hidden: not a tiny-model setting; allowed: vocab_size",
        ),
        ("model.tiny_overrides.num_layers=two", r"model\.tiny_overrides\.num_layers: expected an integer"),
        ("seed.x=1", r"override 'seed\.x=1': seed is not a section"),
        ("trainer.steps", r"override 'trainer\.steps': expected key=value"),
        ("trainer..steps=1", r"empty part in key"),
        ("trainer.correction.method=is", r"trainer\.correction\.method: expected one of none, tis, decoupled, icepop, "
                                         r"m2po, seq_mis, geo_rs, mask_offpolicy, got 'is'"),
        ("trainer.correction.icepop_hi=1", r"unknown config key trainer\.correction\.icepop_hi \(did you mean "
                                           r"'icepop_high'\?\)"),
        ("trainer.correction.tis_cap=0", r"trainer\.correction\.tis_cap: must be > 0\.0, got 0"),
        ("trainer.correction=tis", r"trainer\.correction: expected a mapping, got 'tis'"),
        ("trainer.correction.then=tis", r"trainer\.correction\.then: .* needs trainer\.correction\.method="
                                        r"mask_offpolicy \(method is tis\)"),
        # the keys the one setting replaced are refused, naming it
        ("trainer.use_tis=false", r"trainer\.use_tis: no longer a setting; set trainer\.correction\.method: tis for "
                                  r"use_tis true, none for false"),
        ("trainer.stale_correction=icepop", r"trainer\.stale_correction: no longer a setting; set "
                                            r"trainer\.correction\.method \(one of none, tis,"),
        ("trainer.mask_offpolicy=true", r"trainer\.mask_offpolicy: no longer a setting; set trainer\.correction\."
                                        r"method: mask_offpolicy for true, and trainer\.correction\.then"),
        ("trainer.tis_cap=3", r"trainer\.tis_cap: no longer a setting; set trainer\.correction\.tis_cap"),
        ("trainer.geo_rs_high=1.1", r"trainer\.geo_rs_high: no longer a setting; set trainer\.correction\.geo_rs_high"),
        # the servers are the engine wing's section; the rollout keys that held them are refused, naming it
        ("rollout.n_servers=2", r"rollout\.n_servers: no longer a setting; set servers\.count"),
        ("rollout.endpoints=[]", r"rollout\.endpoints: no longer a setting; set servers\.endpoints"),
        ("rollout.engine_args.tp_size=2", r"rollout\.engine_args: no longer a setting; set servers\.engine_args"),
        ("rollout.server_timeout_s=9", r"rollout\.server_timeout_s: no longer a setting; set servers\.timeout_s"),
        ("rollout.server_startup_s=9", r"rollout\.server_startup_s: no longer a setting; set servers\.startup_s"),
        ("servers.count=0", r"servers\.count: must be >= 1, got 0"),
        ("servers.engine_args.tp_size=two", r"servers\.engine_args\.tp_size: expected an integer, got 'two'"),
        ("servers.engine_args.mem_fraction_static=1.5", r"servers\.engine_args\.mem_fraction_static: must be < 1\.0"),
        ("servers.engine_args.max_running_requests=0", r"servers\.engine_args\.max_running_requests: must be >= 1"),
        ("servers.engine_args.enable_memory_saver=1", r"servers\.engine_args\.enable_memory_saver: expected true or "
                                                     r"false or null, got 1"),
        ("servers.engine_args.max_running_request=64", r"servers\.engine_args\.max_running_request: not a key the "
                                                      r"project reads \(did you mean 'max_running_requests'\?\)"),
        ("servers.timeout_s=0", r"servers\.timeout_s: must be > 0\.0"),
        # what the loop keeps generating, the servers it launches run at once
        ("rollout.max_live=65", r"rollout\.max_live: 65 responses generating at once need more than servers\.count x "
                                r"servers\.engine_args\.max_running_requests = 1 x 64 = 64 .*raise "
                                r"servers\.engine_args\.max_running_requests to 65"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(CONFIGS / "tiny_cpu.yaml", [override])
    assert str(info.value).startswith(str(CONFIGS / "tiny_cpu.yaml"))


def test_cross_section_rules():
    with pytest.raises(ConfigError, match=r"trainer\.ep: expert parallelism needs an MoE model"):
        load_config(None, ["trainer.dp=2", "trainer.ep=2"])
    cfg = load_config(None, ["trainer.dp=2", "trainer.ep=2", "model.moe=true"])
    assert cfg.trainer.world_size == 2
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="log.wandb: true needs the wandb package"):
            load_config(None, ["log.wandb=true"])
    with pytest.raises(ConfigError, match=r"model\.moe / model\.tiny_overrides describe the tiny model"):
        load_config(None, ["model.path=/m", "model.moe=true"])
    no_task = load_config(
        None, ["task.name=math", "task.options.train_path=/nowhere.parquet"], check_task=False
    )
    assert no_task.model.task is None
    with pytest.raises(ConfigError, match=r"task\.options: prompt file /nowhere\.parquet does not exist"):
        load_config(None, ["task.name=math", "task.options.train_path=/nowhere.parquet"])


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: {steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    scalar_section = tmp_path / "s.yaml"
    scalar_section.write_text("trainer: 5\n")
    with pytest.raises(ConfigError, match="trainer: expected a mapping of settings, got 5"):
        load_config(scalar_section)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(empty).to_dict() == RunConfig.from_dict({}).to_dict()


def test_demo_stops_on_a_bad_mode_or_override_before_starting_anything(tmp_path, capsys):
    from rollverify.app.demo import cli_main as demo

    assert demo(["--modes", "on_policy", "fast", "--out", str(tmp_path / "a")]) == 2
    assert "algo.mode" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert demo(["--out", str(tmp_path / "b"), "servers.timeout_s=0"]) == 2
    assert "servers.timeout_s" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert demo(["--modes", "on_policy", "rollverify", "--eval-modes", "partial", "--out", str(tmp_path / "c")]) == 2
    assert "--eval-modes partial: not among --modes" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_paths_are_made_absolute_where_the_config_is_read(tmp_path, monkeypatch):
    """Relative paths mean the driver's working directory: they are made absolute when the config is read, so a
    Ray worker (which starts in a folder of its own) and a later check from elsewhere find the same files."""
    from rollverify.app.cluster import files_read

    here = tmp_path / "here"
    (here / "data").mkdir(parents=True)
    (here / "data" / "train.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    (here / "data" / "aime.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    (here / "model").mkdir()
    monkeypatch.chdir(here)
    cfg = load_config(CONFIGS / "qwen3_8b_base.yaml", ["model.path=model", "task.options.train_path=data/train.jsonl",
                                                       "task.options.eval_path=~/nowhere.parquet",
                                                       "eval.sets={aime: {path: data/aime.jsonl}}"], check_task=False)
    monkeypatch.chdir(tmp_path)  # another working directory: the paths still name the files above
    assert cfg.model.path == str(here / "model")
    assert cfg.task.options["train_path"] == str(here / "data" / "train.jsonl")
    assert cfg.task.options["eval_path"] == str(Path("~/nowhere.parquet").expanduser())
    assert cfg.eval.sets["aime"]["path"] == str(here / "data" / "aime.jsonl")
    assert files_read(cfg, cfg.model.path)[:2] == [str(here / "model") + "/", str(here / "data" / "train.jsonl")]


def test_a_colocated_gpu_run_takes_sglangs_memory_saver(monkeypatch):
    """The servers of a colocated GPU run release their memory to the trainer, which SGLang does only through its
    memory saver: validation turns it on (refusing an explicit false), and the start refuses a machine without
    torch_memory_saver, naming the package; `plan` reads the config anywhere."""
    cfg = load_config(CONFIGS / "qwen3_8b_base.yaml", check_task=False)
    assert cfg.servers.engine_args.enable_memory_saver is True
    with pytest.raises(ConfigError, match=r"enable_memory_saver: false, but a colocated GPU run needs it"):
        load_config(CONFIGS / "qwen3_8b_base.yaml", ["servers.engine_args.enable_memory_saver=false"],
                    check_task=False)
    disagg = load_config(CONFIGS / "qwen3_8b_base.yaml", ["cluster.placement=disaggregated", "cluster.rollout_gpus=16",
                                                          "trainer.dp=8", "servers.count=8",
                                                          "rollout.max_live=192"], check_task=False)
    assert "enable_memory_saver" not in disagg.servers.engine_args.args()
    assert "enable_memory_saver" not in load_config(CONFIGS / "tiny_cpu.yaml").servers.engine_args.args()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_memory_saver"
                        else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the torch_memory_saver package; it is not installed here"):
        cfg.check_installed()
    disagg.check_installed()
