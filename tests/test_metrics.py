"""MetricsWriter: the JSONL record, summary, valid PNG plots, TensorBoard events, resume truncation."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from rollverify.metrics import (
    METRICS,
    STEP_FIELDS,
    MetricsWriter,
    cli_main,
    load_metrics,
    make_record,
    plot_comparison,
    summarize,
)

PNG = b"\x89PNG\r\n\x1a\n"
VERIFY = {  # what the loop adds under verify/: the strategy's statistics, whole
    "verify/cut_by_seq_stage": 2.0,
    "verify/cut_by_token_stage": 1.0,
    "verify/switch_estimate": float("nan"),
    "verify/note": "a string",
}
NO_TB = SimpleNamespace(tensorboard=False, plots=False, wandb=False)


def _step(k: int, mode: str = "rollverify", **kw) -> dict:
    m = {
        "step": k,
        "mode": mode,
        "policy_version": k,
        "reward_mean": 0.3 + 0.01 * k,
        "train/entropy": np.float32(0.5),
        "ops_mean": 0.004,
        "acceptance_rate": 0.9 - 0.05 * k,
        "kept_whole_rate": 0.8,
        "staleness_max": k,
        "n_finished_groups": 8,
        "n_carried": 5,
        "tokens_generated": np.int64(1000),
        "rollout_s": 1.0,
        "train_s": 0.5,
        "verify_s": 0.1,
        "sync_s": 0.2,
        "step_s": 1.8,
        "switched": False,
        "lr": 1e-4,
    }
    m.update(kw)
    return m


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 2000, path
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_record_fields_and_json():
    rec = make_record(_step(3, eval_reward=float("nan"), hist=np.arange(3), extra_obj=object()))
    assert list(rec)[: len(STEP_FIELDS)] == list(STEP_FIELDS)
    assert rec["eval_reward"] is None  # NaN -> null
    assert rec["train/entropy"] == pytest.approx(0.5) and isinstance(rec["tokens_generated"], int)
    assert rec["hist"] == [0, 1, 2] and rec["lr"] == 1e-4 and isinstance(rec["extra_obj"], str)
    json.dumps(rec, allow_nan=False)
    assert make_record({"step": 1})["reward_mean"] is None
    with pytest.raises(ValueError, match="integer 'step'"):
        make_record({"reward_mean": 1.0})


def test_writer_files_and_plots(tmp_path):
    log = SimpleNamespace(tensorboard=True, plots=True, wandb=False)
    with MetricsWriter(tmp_path, log) as w:
        for k in range(1, 7):
            w.write(_step(k, eval_reward=0.4 if k % 3 == 0 else None))
        w.write(_step(7, mode="on_policy", switched=True, acceptance_rate=None, **VERIFY))
        with pytest.raises(ValueError, match="not after"):
            w.write(_step(7))
        summary = w.close(extra={"wall_s": 12.5, "ledger": {"launched": 64}})
    lines = (tmp_path / METRICS).read_text().splitlines()
    assert len(lines) == 7 and all(json.loads(x)["step"] == i for i, x in enumerate(lines, 1))
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["steps"] == 7 and summary["switched_at_step"] == 7 and summary["final_mode"] == "on_policy"
    assert (
        summary["eval_reward_last"] == 0.4
        and summary["wall_s"] == 12.5
        and summary["ledger"] == {"launched": 64}
    )
    assert summary["step_total_s"] == pytest.approx(7 * 1.8) and summary["tokens_generated"] == 7000
    assert summary["acceptance_rate_mean"] == pytest.approx(np.mean([0.9 - 0.05 * k for k in range(1, 7)]))
    names = ("reward", "entropy", "ops", "acceptance", "cuts", "drift", "mismatch", "decode_iters", "step_time", "overview")
    for name in names:
        _assert_png(tmp_path / "plots" / f"{name}.png")
    assert sorted(summary["plots"]) == sorted(f"plots/{n}.png" for n in names)
    last = json.loads(lines[-1])
    assert last["verify/cut_by_seq_stage"] == 2.0 and last["verify/switch_estimate"] is None  # NaN -> null
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward_mean")] == list(range(1, 8))
    assert [(e.step, e.value) for e in acc.Scalars("verify/cut_by_seq_stage")] == [(7, 2.0)]
    assert "verify/switch_estimate" not in acc.Tags()["scalars"]  # null: nothing to draw
    assert "verify/note" not in acc.Tags()["scalars"]  # strings go to the JSONL record only
    with pytest.raises(RuntimeError, match="closed"):
        w.write(_step(8))


def test_resume_truncates_later_steps(tmp_path):
    w = MetricsWriter(tmp_path, NO_TB)
    for k in range(1, 9):
        w.write(_step(k))
    w._file.close()  # a crash: no close(), no summary
    with open(tmp_path / METRICS, "a") as f:
        f.write('{"step": 9, "mode": "rol')  # torn last line
    assert [r["step"] for r in load_metrics(tmp_path)] == list(range(1, 9))
    w2 = MetricsWriter(tmp_path, NO_TB, resume_step=5)  # the checkpoint was at step 5
    assert [r["step"] for r in w2.records] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in load_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    for k in range(6, 10):
        w2.write(_step(k, reward_mean=1.0))
    s = w2.close()
    recs = load_metrics(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 10))
    assert [r["reward_mean"] for r in recs[5:]] == [1.0] * 4  # the redone steps, once each
    assert s["steps"] == 9
    # resume into another directory copies the kept records from the source
    other = tmp_path / "next"
    w3 = MetricsWriter(other, NO_TB, resume_step=3, source=tmp_path)
    w3.close()
    assert [r["step"] for r in load_metrics(other)] == [1, 2, 3]
    assert len(load_metrics(tmp_path)) == 9  # the source is untouched
    # a fresh run (no resume) into a used directory starts over
    MetricsWriter(other, NO_TB).close()
    assert load_metrics(other) == []


def test_tensorboard_purges_on_resume(tmp_path):
    log = SimpleNamespace(tensorboard=True, plots=False, wandb=False)
    w = MetricsWriter(tmp_path, log)
    for k in range(1, 6):
        w.write(_step(k, reward_mean=0.0))
    w.close()
    w = MetricsWriter(tmp_path, log, resume_step=2)
    for k in range(3, 5):
        w.write(_step(k, reward_mean=1.0))
    w.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]


def test_summary_of_nothing_and_nan():
    assert summarize([]) == {"steps": 0}
    s = summarize([make_record({"step": 1, "reward_mean": math.inf})])
    assert s["reward_mean_last"] is None and s["switched_at_step"] is None
    json.dumps(s, allow_nan=False)


def test_comparison_plot_and_cli(tmp_path):
    runs = {}
    for name, mode in (("on_policy", "on_policy"), ("partial", "partial"), ("rollverify", "rollverify")):
        with MetricsWriter(tmp_path / name, NO_TB) as w:
            for k in range(1, 11):
                w.write(_step(k, mode=mode, eval_reward=0.1 * k if k % 5 == 0 else None))
        runs[name] = tmp_path / name
    out = plot_comparison(runs, tmp_path / "cmp" / "compare.png", title="countdown")
    _assert_png(out)
    _assert_png(plot_comparison({"mem": load_metrics(runs["partial"])}, tmp_path / "one.png"))
    with pytest.raises(ValueError, match="at least one run"):
        plot_comparison({}, tmp_path / "none.png")
    assert cli_main(["compare", *map(str, runs.values()), "--out", str(tmp_path / "c2.png")]) == 0
    _assert_png(tmp_path / "c2.png")
    assert cli_main(["plot", str(runs["partial"])]) == 0
    _assert_png(runs["partial"] / "plots" / "overview.png")
    assert cli_main(["plot", str(tmp_path / "empty")]) == 2
    assert cli_main(["compare", str(runs["partial"]), "--out", "x.png", "--labels", "a", "b"]) == 2


def test_wandb_requested_without_package(tmp_path):
    """wandb is not a dependency: asking for it without the package fails clearly, not silently."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="wandb package is not installed"):
            MetricsWriter(tmp_path, SimpleNamespace(tensorboard=False, plots=False, wandb=True))
    else:
        pytest.skip("wandb is installed here")
