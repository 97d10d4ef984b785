"""tools/prepare_data.py: the published layouts of DAPO-Math-17k, AIME24/25, AMC23 and MATH-500 (small local
copies made here) become prompt files the math task and eval.sets read; bad input stops with a clear message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rollverify.app.config import load_config
from rollverify.tasks import get_task, load_prompt_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import prepare_data  # noqa: E402

DAPO_INSTR = "Solve the following math problem step by step. The last line of your response should be ..."


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_every_published_layout(tmp_path):
    dapo = [
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"{DAPO_INSTR}\n\nQ{i % 3}"}],
         "ability": "MATH", "reward_model": {"ground_truth": str(i % 3), "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": f"idx-{i % 3}"}}
        for i in range(9)  # each prompt three times, as the published parquet repeats them
    ]
    layouts = {
        "dapo": [_parquet(tmp_path / "dapo-math-17k.parquet", dapo)],
        # HuggingFaceH4/aime_2024 (id int, answer str) and Maxwell-Jia/AIME_2024 (capitalised, int answers)
        "aime24": [_parquet(tmp_path / "h4.parquet", [{"id": 60, "problem": "P1", "solution": "s", "answer": "204",
                                                      "url": "u", "year": "2024"}]),
                   _jsonl(tmp_path / "mj.jsonl", [{"ID": "2024-II-4", "Problem": "P2", "Solution": "s", "Answer": 33}])],
        # opencompass/AIME2025: question/answer, in two files
        "aime25": [_jsonl(tmp_path / "AIME2025-I.jsonl", [{"question": "P3", "answer": "70"}]),
                   _jsonl(tmp_path / "AIME2025-II.jsonl", [{"question": "P4", "answer": "588"}])],
        # an AMC23 copy with float answers
        "amc23": [_parquet(tmp_path / "amc.parquet", [{"id": 0, "question": "P5", "answer": 27.0, "url": "u"}])],
        "math500": [_jsonl(tmp_path / "test.jsonl", [{"problem": "P6", "solution": "s", "answer": "\\frac{14}{3}",
                                                     "subject": "Algebra", "level": 4,
                                                     "unique_id": "test/algebra/1.json"}])],
    }
    outs = {}
    for name, inputs in layouts.items():
        out = tmp_path / "data" / f"{name}.{'parquet' if name == 'dapo' else 'jsonl'}"
        assert prepare_data.main(["--name", name, "--input", *map(str, inputs), "--out", str(out)]) == 0
        outs[name] = out
    dapo_exs = load_prompt_file(outs["dapo"])
    assert [e.label for e in dapo_exs] == ["0", "1", "2"]  # repeats dropped
    assert dapo_exs[0].messages == tuple(dapo[0]["prompt"])  # the instruction stays as published
    assert [e.meta["extra_info"]["index"] for e in dapo_exs] == ["idx-0", "idx-1", "idx-2"]
    labels = {name: [e.label for e in load_prompt_file(p)] for name, p in outs.items() if name != "dapo"}
    assert labels == {"aime24": ["204", "33"], "aime25": ["70", "588"], "amc23": ["27"], "math500": ["\\frac{14}{3}"]}
    m500 = load_prompt_file(outs["math500"])[0]
    assert m500.messages[0]["role"] == "user" and "\n\nP6\n\n" in m500.messages[0]["content"]
    assert m500.prompt.startswith("Solve the following math problem") and m500.meta["data_source"] == "math500"
    # the math task trains on one and the config evaluates on the others
    cfg = load_config(None, ["task.name=math", f"task.options={{train_path: {outs['dapo']}, eval_fraction: 0.5}}",
                             "eval.sets={" + ", ".join(f"{n}: {p}" for n, p in outs.items() if n != "dapo") + "}"])
    assert list(cfg.eval.sets) == ["aime24", "aime25", "amc23", "math500"]
    task = get_task("math", **cfg.task.options)
    assert task.reward(m500.prompt, "so\nAnswer: $\\dfrac{14}{3}$", m500.label) == 1.0


def test_bad_input(tmp_path, capsys):
    src = _jsonl(tmp_path / "x.jsonl", [{"text": "P", "sol": "1"}])

    def run(*args):
        rc = prepare_data.main(list(args))
        return rc, capsys.readouterr().err

    rc, err = run("--name", "x", "--input", str(tmp_path / "missing.parquet"), "--out", str(tmp_path / "o.jsonl"))
    assert rc == 2 and "does not exist" in err and "never downloads" in err
    rc, err = run("--name", "x", "--input", str(src), "--out", str(tmp_path / "o.jsonl"))
    assert rc == 2 and "no problem column: tried problem" in err and "columns: text, sol" in err
    assert "--prompt-key" in err
    rc, err = run("--name", "x", "--input", str(src), "--prompt-key", "text", "--out", str(tmp_path / "o.jsonl"))
    assert rc == 2 and "no answer column" in err
    rc, _ = run("--name", "x", "--input", str(src), "--prompt-key", "text", "--label-key", "sol",
                "--out", str(tmp_path / "o.jsonl"))
    assert rc == 0
    existing = tmp_path / "o.jsonl"
    before = existing.read_text()
    rc, err = run("--name", "x", "--input", str(src), "--prompt-key", "text", "--label-key", "sol",
                  "--out", str(existing))
    assert rc == 2 and "exists" in err and existing.read_text() == before  # never overwritten
    rc, err = run("--name", "x", "--input", str(src), "--out", str(tmp_path / "o.csv"))
    assert rc == 2 and "use a .jsonl or .parquet" in err


def test_humaneval_without_input_reads_the_installed_package(tmp_path, capsys):
    out = tmp_path / "he.jsonl"
    assert prepare_data.main(["--name", "humaneval", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 164 and all(r["ability"] == "code" for r in rows)
    first = json.loads(rows[0]["reward_model"]["ground_truth"])
    assert first["kind"] == "humaneval" and first["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in first["test"] and "def has_close_elements" in first["prompt"]
    assert "164 prompts" in capsys.readouterr().out
    rc = prepare_data.main(["--name", "dapo", "--out", str(tmp_path / "d.jsonl")])
    assert rc == 2 and "give --input" in capsys.readouterr().err
