"""Run-directory metrics: ``metrics.jsonl`` (one object per step), ``summary.json``, PNG plots, TensorBoard.

The JSONL file is the record of truth: it is appended and flushed after every step, so a crashed run keeps
everything up to its last step, and a resumed run drops the steps after its checkpoint (they will be redone)
instead of logging them twice. Plots and the summary are derived from it and can be rebuilt at any time
(``python -m rollverify.metrics plot DIR``); ``compare`` draws several runs side by side for the demo.
Non-finite numbers are written as null (strict JSON). A record holds the standard fields plus whatever else
the step logged, such as the strategy's statistics under ``verify/``; TensorBoard and wandb get every
numeric value, plots draw their fixed panels and skip what a run did not log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOTS = "plots"
TENSORBOARD = "tensorboard"

# Every record has these keys (null when the step did not produce the value), then any extra ones.
#
# The rule for every figure a step logs (here and under its prefixes: train/, verify/, tools/, sync/, ...): which
# keys a record holds depends on the run's configuration, never on what the step happened to contain. A figure
# the step had nothing to measure for (no carried-over token, no token of an older version, no tool call, no
# cut) is present: a count is 0 and a statistic over nothing (a mean, a rate, a maximum) is NaN in memory and
# null in metrics.jsonl. So a reader tests a count, never a key: `r["train/mismatch_abs_max"] for r in rows if
# r["train/mismatch_tokens"]`. (tests/test_loop_logic.py and test_async_loop.py hold both schedules to it.)
STEP_FIELDS = (
    "step",
    "mode",
    "policy_version",
    "reward_mean",
    "eval_reward",
    "train/entropy",
    "ops_mean",
    "acceptance_rate",
    "kept_whole_rate",
    "staleness_max",
    "n_finished_groups",
    "n_carried",
    "tokens_generated",
    "decode_iters",
    "rollout_s",
    "train_s",
    "verify_s",
    "logprob_wait_s",
    "sync_s",
    "step_s",
    "switched",
)
# the step's phases; logprob_wait_s only with `algo.verify_on: engine` (the wait for the engines' log-probs)
TIME_FIELDS = ("rollout_s", "train_s", "verify_s", "logprob_wait_s", "sync_s", "step_s")


def _jsonable(v: Any) -> Any:
    """Plain JSON values: numpy scalars and arrays unwrapped, NaN/inf -> None, unknown objects -> str."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if hasattr(v, "tolist"):  # numpy / torch scalars and arrays
        return _jsonable(v.tolist())
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


def make_record(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The standard fields in order (missing ones null), then the extra ones."""
    if (
        "step" not in metrics
        or isinstance(metrics["step"], bool)
        or not isinstance(_jsonable(metrics["step"]), int)
    ):
        raise ValueError(f"a metrics record needs an integer 'step', got {metrics.get('step')!r}")
    rec = {k: _jsonable(metrics.get(k)) for k in STEP_FIELDS}
    rec.update({k: _jsonable(v) for k, v in metrics.items() if k not in rec})
    return rec


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a run directory or a metrics.jsonl file; a torn last line (crash mid-write) is ignored."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    if not path.is_file():
        return []
    out = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not a JSON object") from None
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [
        float(r[key])
        for r in records
        if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)
    ]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def switch_step(records: Sequence[Mapping[str, Any]]) -> int | None:
    """First step that switched to on_policy (its `switched` flag, or a change of mode)."""
    prev = None
    for r in records:
        if r.get("switched"):
            return r["step"]
        if prev is not None and r.get("mode") != prev and r.get("mode") == "on_policy":
            return r["step"]
        prev = r.get("mode")
    return None


def summarize(records: Sequence[Mapping[str, Any]], last_n: int = 10) -> dict[str, Any]:
    """Run-level numbers: final and best rewards, time spent per phase, verification rates, the switch."""
    if not records:
        return {"steps": 0}
    evals = [(r["step"], r["eval_reward"]) for r in records if isinstance(r.get("eval_reward"), (int, float))]
    out: dict[str, Any] = {
        "steps": len(records),
        "last_step": records[-1]["step"],
        "final_mode": records[-1].get("mode"),
        "first_mode": records[0].get("mode"),
        "reward_mean_first": _mean(_values(records[:last_n], "reward_mean")),
        "reward_mean_last": _mean(_values(records[-last_n:], "reward_mean")),
        "eval_reward_last": evals[-1][1] if evals else None,
        "eval_reward_best": max(v for _, v in evals) if evals else None,
        "eval_reward_best_step": max(evals, key=lambda e: e[1])[0] if evals else None,
        "entropy_last": _mean(_values(records[-last_n:], "train/entropy")),
        "ops_mean": _mean(_values(records, "ops_mean")),
        "acceptance_rate_mean": _mean(_values(records, "acceptance_rate")),
        "kept_whole_rate_mean": _mean(_values(records, "kept_whole_rate")),
        "staleness_max": max(_values(records, "staleness_max"), default=None),
        "tokens_generated": sum(_values(records, "tokens_generated")),
        "decode_iters_mean": _mean(_values(records, "decode_iters")),
        "switched_at_step": switch_step(records),
        "step_s_mean": _mean(_values(records, "step_s")),
    }
    for k in TIME_FIELDS:
        out[f"{k[:-2]}_total_s"] = sum(_values(records, k))
    evals_last = {}
    for key in eval_set_keys(records):  # eval/<set>/avg@k, pass@k: the last value of each
        vals = _values(records, key)
        evals_last[key] = vals[-1] if vals else None
    if evals_last:
        out["eval_sets_last"] = evals_last
    return _jsonable(out)


def eval_set_keys(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The per-set evaluation keys (``eval/<set>/avg@k``, ``eval/<set>/pass@k``) in first-seen order."""
    keys: dict[str, None] = {}
    for r in records:
        keys.update((k, None) for k in r if k.startswith("eval/"))
    return list(keys)


class MetricsWriter:
    """Writes one run directory's metrics as the run goes.

    `log` is the config's `log` section (or anything with `tensorboard`, `plots`, `wandb`, `wandb_project`,
    `wandb_mode`, `run_name` attributes; None: TensorBoard and plots on). With `resume_step`, the records of
    `source` (default: this directory) after that step are dropped before anything new is written.
    """

    def __init__(
        self,
        run_dir: str | Path,
        log: Any = None,
        resume_step: int | None = None,
        source: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS
        self.tensorboard = bool(getattr(log, "tensorboard", True))
        self.plots = bool(getattr(log, "plots", True))
        self.records: list[dict[str, Any]] = []
        if resume_step is not None:
            src = Path(source) if source is not None else self.dir
            self.records = [
                r for r in load_metrics(src) if r.get("step") is not None and r["step"] <= resume_step
            ]
        _write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._file = self.path.open("a")
        self._tb = None
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(self.dir / TENSORBOARD), purge_step=purge)
            if source is not None and Path(source) != self.dir:
                for r in self.records:  # a resume into a new directory gets the earlier curves too
                    self._tb_add(r)
        self._wandb = None
        if getattr(log, "wandb", False):
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("log.wandb is true but the wandb package is not installed") from e
            self._wandb = wandb.init(
                project=getattr(log, "wandb_project", "rollverify"),
                name=getattr(log, "run_name", None) or self.dir.name,
                dir=str(self.dir),
                mode=getattr(log, "wandb_mode", "offline"),
                config=dict(config or {}),
                resume="allow",
            )
        self.closed = False

    def _tb_add(self, rec: Mapping[str, Any]) -> None:
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, float(v), rec["step"])

    def write(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one step's record (flushed at once); returns it as written."""
        if self.closed:
            raise RuntimeError("MetricsWriter is closed")
        rec = make_record(metrics)
        if self.records and rec["step"] <= self.records[-1]["step"]:
            raise ValueError(
                f"step {rec['step']} is not after the last written step {self.records[-1]['step']}"
            )
        self.records.append(rec)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb_add(rec)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=rec["step"])
        return rec

    def rewind(self, step: int) -> None:
        """Forget the records after `step` (a run that restarted from its checkpoint at `step` redoes them):
        metrics.jsonl is rewritten without them, TensorBoard purges them when the step after `step` is written
        again. wandb keeps what it was sent (its runs take steps in order only)."""
        if self.closed:
            raise RuntimeError("MetricsWriter is closed")
        if self.records and self.records[-1]["step"] <= step:
            return
        self.records = [r for r in self.records if r["step"] <= step]
        self._file.close()
        _write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._file = self.path.open("a")
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=str(self.dir / TENSORBOARD), purge_step=step + 1)

    def close(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write summary.json (and plots); release TensorBoard and wandb. Returns the summary."""
        summary = summarize(self.records)
        summary.update(_jsonable(dict(extra or {})))
        if not self.closed:
            self.closed = True
            self._file.close()
            if self.plots and self.records:
                summary["plots"] = [
                    str(p.relative_to(self.dir)) for p in plot_run(self.records, self.dir / PLOTS)
                ]
            _write_atomic(self.dir / SUMMARY, json.dumps(summary, indent=1) + "\n")
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
                self._wandb.finish()
        return summary

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- plots ---------------------------------------------------------------------------------------------------

# (file name, title, [(key, label)], y label)
PANELS = (
    ("reward", "Reward", [("reward_mean", "train (rollout)"), ("eval_reward", "eval")], "mean reward"),
    ("entropy", "Entropy", [("train/entropy", "entropy")], "nats / token"),
    ("ops", "Off-policy shift", [("ops_mean", "mean OPS")], "OPS"),
    (
        "acceptance",
        "Verification",
        [("acceptance_rate", "acceptance"), ("kept_whole_rate", "kept whole")],
        "rate",
    ),
    (
        "cuts",
        "Verification cuts",
        [
            ("verify/cut_by_seq_stage", "by sequence stage"),
            ("verify/cut_by_token_stage", "by token stage"),
            ("verify/restarted", "restarted"),
        ],
        "responses",
    ),
    (
        "drift",
        "Drift by age: carried tokens' OPS (and d_s in use)",
        [
            ("verify/drift/age1_ops_mean", "1 version old"),
            ("verify/drift/age2_ops_mean", "2 versions old"),
            ("verify/drift/age3p_ops_mean", "3+ versions old"),
            ("train/mismatch_ops_mean", "same version (engine/trainer floor)"),
            ("verify/d_s", "d_s"),
        ],
        "mean |p_new / p_old - 1|",
    ),
    (
        "mismatch",
        "Trained tokens: trainer vs engine log-probs",
        [
            ("train/mismatch_ops_mean", "mismatch (tokens of the trainer's weights)"),
            ("train/drift_ops_mean", "drift (older tokens)"),
        ],
        "mean |p_train / p_engine - 1|",
    ),
    (
        "decode_iters",
        "Rollout decode iterations (hardware-neutral rollout time)",
        [("decode_iters", "decode iterations")],
        "iterations / step",
    ),
    (
        "step_time",
        "Step time",
        [
            ("step_s", "step"),
            ("rollout_s", "rollout"),
            ("train_s", "train"),
            ("verify_s", "verify"),
            ("logprob_wait_s", "log-prob wait (engine)"),
            ("sync_s", "sync"),
        ],
        "seconds",
    ),
)


def _series(
    records: Sequence[Mapping[str, Any]], key: str, x: str = "step"
) -> tuple[list[float], list[float]]:
    """(x, y) of `key` against `x`: "step", "time" (cumulative step_s, minutes) or "iters" (cumulative
    decode_iters, thousands)."""
    xs, ys = [], []
    t = 0.0
    for r in records:
        if x == "time":
            t += float(r.get("step_s") or 0.0) / 60.0
        elif x == "iters":
            t += float(r.get("decode_iters") or 0.0) / 1000.0
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(t if x != "step" else r["step"])
            ys.append(float(v))
    return xs, ys


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (6.0, 3.6)):
    """A pyplot-free figure (no global state, no display backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


# panels whose series differ by orders of magnitude (the kernels' floor beside a policy's drift)
LOG_PANELS = frozenset({"mismatch", "drift"})


def _draw_panel(ax, records, title, series, ylabel, switch, log: bool = False) -> None:
    drawn = False
    if log:
        ax.set_yscale("log")
    for key, label in series:
        xs, ys = _series(records, key)
        if log:
            xs, ys = [x for x, y in zip(xs, ys, strict=True) if y > 0], [y for y in ys if y > 0]
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            drawn = True
    if switch is not None:
        ax.axvline(switch, color="gray", linestyle="--", linewidth=1, label="switch to on_policy")
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn and (len(series) > 1 or switch is not None):
        ax.legend(fontsize=8)


def plot_run(records: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """One PNG per panel (reward, entropy, OPS, acceptance, cuts, drift by age, mismatch, decode iterations, step
    time), an overview with all of them, and the what-if acceptance curves (whatif.png) where verification logged
    them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    switch = switch_step(records)
    paths = []
    for name, title, series, ylabel in PANELS:
        fig, (ax,) = _figure()
        _draw_panel(ax, records, title, series, ylabel, switch, log=name in LOG_PANELS)
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
    fig, axes = _figure(-(-len(PANELS) // 4), 4, size=(5.0, 3.4))
    for ax, (name, title, series, ylabel) in zip(axes, PANELS, strict=False):
        _draw_panel(ax, records, title, series, ylabel, switch, log=name in LOG_PANELS)
    for ax in axes[len(PANELS) :]:
        ax.set_visible(False)
    paths.append(out_dir / "overview.png")
    fig.savefig(paths[-1], dpi=90)
    whatif = plot_whatif(records, out_dir / "whatif.png")
    if whatif is not None:
        paths.append(whatif)
    keys = eval_set_keys(records)
    if keys:  # one panel per statistic (avg@k, pass@k), one line per eval set
        stats = sorted({k.rsplit("/", 1)[1] for k in keys})
        fig, axes = _figure(1, len(stats))
        for ax, stat in zip(axes, stats, strict=True):
            series = [(k, k.split("/")[1]) for k in keys if k.endswith("/" + stat)]
            _draw_panel(ax, records, f"Eval {stat}", series, stat, switch)
        paths.append(out_dir / "eval_sets.png")
        fig.savefig(paths[-1], dpi=100)
    return paths


WHATIF_PREFIX = "verify/whatif/ds_"


def whatif_curves(records: Sequence[Mapping[str, Any]]) -> dict[int, list[tuple[float, float]]]:
    """step -> [(d_s, acceptance)] of the what-if curve each verification logged (the sequence stage alone at
    each d_s of rollverify.calibration.D_S_GRID), sorted by d_s."""
    out = {}
    for r in records:
        pts = sorted((float(k.removeprefix(WHATIF_PREFIX)), float(v)) for k, v in r.items()
                     if k.startswith(WHATIF_PREFIX) and isinstance(v, (int, float)))
        if pts:
            out[r["step"]] = pts
    return out


def plot_whatif(records: Sequence[Mapping[str, Any]], out: str | Path) -> Path | None:
    """The what-if acceptance curves (acceptance against d_s, log scale) of a few steps spread over the run and
    their mean, with the d_s the run verified at; None when no step logged one."""
    curves = whatif_curves(records)
    if not curves:
        return None
    steps = sorted(curves)
    shown = sorted({steps[round(i * (len(steps) - 1) / 4)] for i in range(5)})
    fig, (ax,) = _figure()
    ax.set_xscale("log")
    for k in shown:
        xs, ys = zip(*curves[k], strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, label=f"step {k}")
    grid = sorted({x for c in curves.values() for x, _ in c})
    mean = [sum(dict(c).get(x, math.nan) for c in curves.values()) / len(curves) for x in grid]
    ax.plot(grid, mean, color="black", linewidth=2, label="mean over steps")
    d_s = _values(records, "verify/d_s")
    if d_s:
        ax.axvline(sum(d_s) / len(d_s), color="gray", linestyle="--", linewidth=1, label="d_s in use (mean)")
    ax.set_title("What-if acceptance of the sequence stage")
    ax.set_xlabel("d_s")
    ax.set_ylabel("kept / verified tokens")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(out)
    fig.savefig(out, dpi=100)
    return out


# (title, key, x axis, y label) of the comparison figure
COMPARE_PANELS = (
    ("Train reward", "reward_mean", "step", "mean reward"),
    ("Eval reward vs time", "eval_reward", "time", "mean reward"),
    ("Entropy", "train/entropy", "step", "nats / token"),
    ("Off-policy shift", "ops_mean", "step", "mean OPS"),
    ("Acceptance rate", "acceptance_rate", "step", "rate"),
    ("Step time", "step_s", "step", "seconds"),
    ("Rollout decode iterations", "decode_iters", "step", "iterations / step"),
    ("Eval reward vs decode iterations", "eval_reward", "iters", "mean reward"),
)


def plot_comparison(
    runs: Mapping[str, str | Path | Sequence[Mapping[str, Any]]] | Sequence[str | Path],
    out: str | Path,
    title: str | None = None,
) -> Path:
    """Several runs side by side (one line each; a dashed line of the same colour where a run switched to
    on_policy): `runs` maps labels to run directories or records, or lists run directories (named by folder)."""
    if not isinstance(runs, Mapping):
        runs = {Path(p).name: p for p in runs}
    loaded = {
        label: (load_metrics(src) if isinstance(src, (str, Path)) else list(src))
        for label, src in runs.items()
    }
    if not loaded:
        raise ValueError("plot_comparison needs at least one run")
    fig, axes = _figure(2, 4, size=(5.0, 3.4))
    for ax, (ptitle, key, x, ylabel) in zip(axes, COMPARE_PANELS, strict=True):
        drawn = False
        for label, records in loaded.items():
            xs, ys = _series(records, key, x)
            if xs:
                (line,) = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                drawn = True
                sw = switch_step(records)
                if sw is not None and x == "step":  # where this run switched to on_policy
                    ax.axvline(sw, color=line.get_color(), linestyle="--", linewidth=1)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(ptitle)
        ax.set_xlabel(
            {"time": "wall-clock minutes (sum of step times)", "iters": "thousand decode iterations (cumulative)"}
            .get(x, "step")
        )
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return out


def cli_main(argv: list[str] | None = None) -> int:
    """Rebuild one run's plots and summary, or compare runs."""
    p = argparse.ArgumentParser(prog="python -m rollverify.metrics", description=cli_main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plot", help="plots/ and summary.json of a run directory from its metrics.jsonl")
    pp.add_argument("run_dir")
    pc = sub.add_parser("compare", help="side-by-side PNG of several run directories")
    pc.add_argument("run_dirs", nargs="+")
    pc.add_argument("--out", required=True)
    pc.add_argument("--labels", nargs="*", default=None)
    pc.add_argument("--title", default=None)
    a = p.parse_args(argv)
    if a.cmd == "plot":
        records = load_metrics(a.run_dir)
        if not records:
            print(f"error: no records in {Path(a.run_dir) / METRICS}", file=sys.stderr)
            return 2
        for path in plot_run(records, Path(a.run_dir) / PLOTS):
            print(path)
        summary_path = Path(a.run_dir) / SUMMARY
        old = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        _write_atomic(summary_path, json.dumps({**old, **summarize(records)}, indent=1) + "\n")
        return 0
    labels = a.labels or [Path(d).name for d in a.run_dirs]
    if len(labels) != len(a.run_dirs):
        print("error: --labels needs one label per run directory", file=sys.stderr)
        return 2
    print(plot_comparison(dict(zip(labels, a.run_dirs, strict=True)), a.out, a.title))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
