"""tools/experiments/paper_tables.py's aggregation and claim checks on written run folders (no run is started)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "experiments"))
import paper_tables as pt  # noqa: E402

from rollverify.pricing import PRICES  # noqa: E402

# per run: (eval reward, trained-token OPS, acceptance, decode iterations per step); each claim of the paper holds
HOLDS = {
    "on_policy": (0.50, 0.0, None, 140.0),
    "partial": (0.40, 0.004, None, 25.0),
    "seq": (0.42, 0.003, 0.80, 30.0),
    "seq_token": (0.44, 0.002, 0.85, 31.0),
    "rollverify": (0.46, 0.002, 0.85, 31.0),
    "ds_0.005": (0.45, 0.001, 0.70, 40.0),
    "ds_0.02": (0.41, 0.003, 0.90, 28.0),
    "ds_0.05": (0.40, 0.004, 0.95, 26.0),
    "dt_1": (0.44, 0.002, 0.80, 32.0),
    "dt_4": (0.43, 0.002, 0.84, 30.0),
    "partial_gspo": (0.41, 0.004, None, 25.0),
    "partial_sapo": (0.42, 0.004, None, 25.0),
    "partial_vespo": (0.43, 0.004, None, 25.0),
}


def write_run(run_dir: Path, eval_reward: float, ops: float, acceptance: float | None, iters: float,
              grow: float = 1.0, steps: int = 6) -> None:
    """A finished run: `steps` records whose OPS and entropy grow by `grow` from the first third to the last."""
    run_dir.mkdir(parents=True)
    records = []
    for step in range(1, steps + 1):
        late = step > steps * 2 // 3
        records.append({
            "step": step, "step_s": 1.0, "decode_iters": iters, "acceptance_rate": acceptance,
            "tokens_generated": 300, "prefill_tokens": 500,
            "trained_ops_mean": ops * (grow if late else 1.0), "train/entropy": 0.1 * (grow if late else 1.0),
            "eval_reward": eval_reward if step == steps else None,
        })
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.json").write_text(json.dumps(
        {"wall_s": 60.0, "ledger": {"generated_tokens": 150, "trained_tokens": 100}}))


def write_all(out: Path, runs: dict, seeds=(0, 1)) -> None:
    for name, (ev, ops, acc, iters) in runs.items():
        for s in seeds:
            write_run(out / name / f"s{s}", ev + 0.01 * s, ops, acc, iters, grow=1.5 if name == "partial" else 1.0)


def verdicts(out: Path, seeds=(0, 1)) -> dict[str, str]:
    return {claim.split(" (")[0]: verdict for claim, verdict, _ in pt.claims(pt.aggregate(out, list(seeds)))}


def test_every_claim_holds_on_runs_made_to_hold_it(tmp_path):
    write_all(tmp_path, HOLDS)
    got = verdicts(tmp_path)
    assert list(got.values()) == ["yes"] * 5, got
    agg = pt.aggregate(tmp_path, [0, 1])
    assert agg["partial"]["seeds"] == 2
    assert agg["partial"]["eval_reward"] == pytest.approx({"mean": 0.405, "min": 0.40, "max": 0.41, "n": 2})
    assert agg["partial"]["generated_per_trained"]["mean"] == pytest.approx(1.5)
    assert agg["partial"]["ops_last_third"]["mean"] == pytest.approx(0.006)


@pytest.mark.parametrize(("run", "change", "claim"), [
    ("on_policy", {0: 0.39}, "partial rollout loses accuracy, and its OPS and entropy grow"),
    ("seq_token", {1: 0.0035}, "each stage helps"),
    ("seq_token", {2: 0.75}, "the token stage raises acceptance"),
    ("ds_0.05", {3: 60.0}, "smaller d_s is more accurate and slower"),
    ("partial_vespo", {0: 0.47}, "loss reshaping does not close the gap that sample verification closes"),
])
def test_a_claim_the_numbers_break_reads_no(tmp_path, run, change, claim):
    runs = dict(HOLDS)
    runs[run] = tuple(change.get(i, x) for i, x in enumerate(HOLDS[run]))
    write_all(tmp_path, runs)
    got = verdicts(tmp_path)
    assert got.pop(claim) == "no"
    assert set(got.values()) == {"yes"}


def test_a_missing_run_reads_na_and_the_report_says_how_many_seeds(tmp_path):
    write_all(tmp_path, {k: v for k, v in HOLDS.items() if k != "partial_sapo"})
    got = verdicts(tmp_path)
    assert got["loss reshaping does not close the gap that sample verification closes"] == "n/a"
    agg = pt.aggregate(tmp_path, [0, 1])
    report = pt.write_report(tmp_path, [0, 1], agg, [], {"ran": [], "failed": [], "wall_s": 0.0})
    text = report.read_text()
    assert "| partial SAPO (`partial_sapo`) | — | — | — | — | — | — | — | 0 |" in text
    priced = pt._cell(agg, "partial", "priced", "{:.1f}")
    assert f"| partial (`partial`) | {priced} | 25.0 [25.0, 25.0] | 1.50 [1.50, 1.50] | 1.00 [1.00, 1.00] |" in text
    assert priced.startswith(f"{25.0 + 300 / PRICES.decode_tokens_per_iter + 500 / PRICES.prefill_tokens_per_iter:.1f}")


def test_eval_interval_is_over_seeds_and_over_prompts_for_one_seed(tmp_path):
    write_all(tmp_path, {"partial": HOLDS["partial"], "spec_rl": (0.3, 0.001, 0.9, 20.0)})
    agg = pt.aggregate(tmp_path, [0, 1])
    # evals 0.40 and 0.41: standard error 0.005 over the two seeds
    assert agg["partial"]["eval_interval"] == pytest.approx({"mean": 0.405, "half": 1.96 * 0.005, "n": 2})
    recs = (tmp_path / "spec_rl" / "s0" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(recs[-1]) | {"eval_reward_se": 0.02}
    (tmp_path / "spec_rl" / "s0" / "metrics.jsonl").write_text("\n".join([*recs[:-1], json.dumps(last)]) + "\n")
    one = pt.aggregate(tmp_path, [0])
    assert one["spec_rl"]["eval_interval"] == pytest.approx({"mean": 0.3, "half": 1.96 * 0.02, "n": 1})
    report = pt.write_report(tmp_path, [0], one, [], {"ran": [], "failed": [], "wall_s": 0.0}).read_text()
    assert "| SPEC-RL cut (`spec_rl`) | 0.300 [0.300, 0.300] | 0.300 +- 0.039 |" in report
