"""Tasks: the countdown reward and its long tail, split determinism, the math reward, prompt-file loaders."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollverify.tasks import (
    CountdownTask,
    FileTask,
    Task,
    extract_answer,
    get_task,
    load_prompt_file,
    math_equal,
    math_reward,
    normalize_answer,
    synthetic_task_names,
    task_names,
)

# --- countdown -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task() -> CountdownTask:
    return get_task("countdown")


def test_registry(task):
    assert {"countdown", "countdown_short", "math"} <= set(task_names())
    assert set(synthetic_task_names()) == {"countdown", "countdown_short", "toolchain"}
    assert isinstance(task, Task)
    assert get_task("countdown_short").k_max == 16
    with pytest.raises(ValueError, match="unknown task 'nope'.*countdown"):
        get_task("nope")
    with pytest.raises(ValueError, match="bogus"):
        get_task("countdown", bogus=1)
    with pytest.raises(ValueError, match="k_min"):
        get_task("countdown", k_min=5, k_max=3)
    with pytest.raises(ValueError, match="width"):
        get_task("countdown", width=2)


def test_example_and_demonstration(task):
    ex = task.make_example(stride=7, k=8, remainder=3)
    assert ex.prompt == "052 mod 7\n" and ex.label == "3"
    assert task.demonstration(ex) == "052 045 038 031 024 017 010 003\n=003"
    assert task.reward(ex.prompt, task.demonstration(ex), ex.label) == 1.0
    assert task.make_example(1, 3, 0).prompt == "002 mod 1\n"
    with pytest.raises(ValueError):
        task.make_example(stride=3, k=2, remainder=3)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("052 045 038 031 024 017 010 003\n=003", 1.0),
        ("052 045 038 031 024 017 010 003\n=3", 1.0),  # the number, not its padding, is the answer
        ("052 045 038 031 024 017 010 003\n=003\n", 1.0),  # trailing whitespace
        ("052 045 038 031 024 017 010 003\n=003<|endoftext|>junk\n=5", 1.0),  # text after EOS is ignored
        ("052 045 038 031 024 017 010 003\n=004", 0.0),  # wrong answer
        ("052 045 038 031 024 017 010 003", 0.0),  # truncated: no answer line
        ("=003", 0.0),  # no chain
        ("\n=003", 0.0),  # empty chain
        ("052 045\n=abc", 0.0),
        ("052 045\n= ", 0.0),
        ("052 045\n=003 is it", 0.0),
        ("", 0.0),
        ("\x00\x01 garbage \t", 0.0),
    ],
)
def test_countdown_reward(task, response, expected):
    assert task.reward("052 mod 7\n", response, "3") == expected


def test_format_reward_is_partial_credit():
    t = get_task("countdown", format_reward=0.1)
    assert t.reward("", "9 6 3\n=3", "0") == pytest.approx(0.1)
    assert t.reward("", "9 6 3 0\n=0", "0") == 1.0
    assert t.reward("", "9 6 3 0", "0") == 0.0


def test_splits_are_deterministic_and_disjoint(task):
    a = task.examples("train", 200, seed=3)
    assert [e.prompt for e in a] == [e.prompt for e in task.examples("train", 200, seed=3)]
    assert [e.prompt for e in a] != [e.prompt for e in task.examples("train", 200, seed=4)]
    ev = task.examples("eval", 300, seed=0)
    assert [e.uid for e in ev] == [e.uid for e in task.examples("eval", 300, seed=0)]
    train_prompts = {e.prompt for e in task.examples("train", 3000, seed=0)}
    eval_prompts = {e.prompt for e in ev}
    assert eval_prompts and not (train_prompts & eval_prompts)
    assert all(task.split_of(p) == "eval" for p in eval_prompts)
    # another salt is another split
    other = get_task("countdown", split_salt="x")
    assert {e.prompt for e in other.examples("eval", 300)} != eval_prompts
    with pytest.raises(ValueError, match="split must be one of train, eval"):
        task.examples("test", 3)
    with pytest.raises(ValueError, match="without end: pass n"):
        task.examples("eval")


def test_lengths_are_long_tailed(task):
    lengths = np.array([len(task.demonstration(e)) for e in task.examples("train", 4000, seed=1)])
    med, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert p99 / med >= 5, (med, p99)
    assert lengths.mean() > 1.3 * med  # the mean sits far right of the median
    assert lengths.max() <= task.max_response_chars
    ks = np.array([e.meta["k"] for e in task.examples("train", 4000, seed=1)])
    assert ks.min() >= task.k_min and ks.max() <= task.k_max
    short = get_task("countdown_short")
    assert (
        max(len(short.demonstration(e)) for e in short.examples("train", 500))
        <= short.max_response_chars
        <= 70
    )


# --- math reward -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}} and later \\boxed{7}", "7"),  # the last one
        ("\\boxed{\\frac{a}{\\sqrt{b}}}", "\\frac{a}{\\sqrt{b}}"),  # nested braces
        ("\\boxed 5$", "5"),
        ("work...\nAnswer: 34", "34"),
        ("answer : $17$\n", "$17$"),
        ("\\boxed{3}\nAnswer: 4", "4"),  # Answer line after the box wins
        ("Answer: 4\nactually \\boxed{3}", "3"),
        ("Answer: \\boxed{9}", "9"),
        ("no answer here", None),
        ("\\boxed{12", None),  # unbalanced: no answer, no crash
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("pred", "truth", "equal"),
    [
        ("42", "42", True),
        ("$42$", "42", True),
        ("42.", "42", True),
        ("42.0", "42", True),
        ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("\\frac12", "\\frac{1}{2}", True),
        ("1/2", "\\frac{1}{2}", True),
        ("0.5", "\\frac{1}{2}", True),
        ("-\\frac{3}{4}", "-0.75", True),
        ("x = 5", "5", True),
        ("1,000", "1000", True),
        ("5 \\text{ dollars}", "5", True),
        ("90^\\circ", "90", True),
        ("\\left(1, 2\\right)", "(1,2)", True),
        ("\\boxed{7}", "7", True),
        ("{7}", "7", True),
        ("43", "42", False),
        ("\\frac{1}{3}", "0.33", False),
        ("", "0", False),
        ("2", "", False),
        ("1/0", "1/0", True),  # equal strings, even if not numbers
        ("1/0", "2/0", False),
    ],
)
def test_math_equal(pred, truth, equal):
    assert math_equal(pred, truth) is equal


def test_math_reward():
    assert math_reward("Let me think.\nAnswer: 34", "34") == 1.0
    assert math_reward("The answer is \\boxed{\\dfrac{3}{4}}.", "0.75") == 1.0
    assert math_reward("The answer is \\boxed{5}.", "6") == 0.0
    assert math_reward("I don't know", "6") == 0.0
    assert math_reward("", "6") == 0.0
    assert math_reward("\\boxed{}", "6") == 0.0
    assert normalize_answer("  \\text{(A)} ") == "(A)"


# --- prompt files ----------------------------------------------------------------------------------------

DAPO_PROMPT = "Solve the following math problem step by step. The last line of your response should be of the form Answer: $Answer"


def _dapo_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"{DAPO_PROMPT}\n\nWhat is {i} + {i}?"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in range(n)
    ]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_flat_jsonl(tmp_path):
    rows = [{"prompt": f"What is {i}*2?", "label": 2 * i, "other": "x"} for i in range(5)]
    exs = load_prompt_file(_write_jsonl(tmp_path / "flat.jsonl", rows))
    assert [e.prompt for e in exs] == [r["prompt"] for r in rows]
    assert [e.label for e in exs] == ["0", "2", "4", "6", "8"]
    assert exs[0].messages is None and exs[0].meta["other"] == "x"
    assert len({e.uid for e in exs}) == 5
    # uids hash content, so a reordered file keeps them
    again = load_prompt_file(_write_jsonl(tmp_path / "rev.jsonl", rows[::-1]))
    assert {e.uid for e in again} == {e.uid for e in exs}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dapo_layout(tmp_path, fmt):
    rows = _dapo_rows(6)
    path = (_write_jsonl if fmt == "jsonl" else _write_parquet)(tmp_path / f"dapo.{fmt}", rows)
    exs = load_prompt_file(path)  # label found at reward_model.ground_truth
    assert [e.label for e in exs] == [str(2 * i) for i in range(6)]
    assert exs[3].messages == ({"role": "user", "content": rows[3]["prompt"][0]["content"]},)
    assert exs[3].prompt.endswith("What is 3 + 3?")
    assert exs[3].meta["data_source"] == "math_dapo"
    by_id = load_prompt_file(path, uid_key="extra_info.index", label_key="reward_model.ground_truth")
    assert [e.uid for e in by_id] == [f"id-{i}" for i in range(6)]


def test_configurable_keys(tmp_path):
    rows = [{"question": "q1", "sol": {"final": "1"}}, {"question": "q2", "sol": {"final": "2"}}]
    exs = load_prompt_file(
        _write_jsonl(tmp_path / "k.jsonl", rows), prompt_key="question", label_key="sol.final"
    )
    assert [(e.prompt, e.label) for e in exs] == [("q1", "1"), ("q2", "2")]


def test_loader_errors(tmp_path):
    p = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "label": "1"}, {"prompt": "q"}])
    with pytest.raises(ValueError, match=r"row 1: missing label column 'label'; columns: prompt"):
        load_prompt_file(p, label_key="label")
    with pytest.raises(ValueError, match=r"missing prompt column 'question'"):
        load_prompt_file(p, prompt_key="question")
    nolabel = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "solution": "1"}])
    with pytest.raises(
        ValueError,
        match=r"no label column: tried label, reward_model.ground_truth.*columns: prompt, solution",
    ):
        load_prompt_file(nolabel)
    pq_path = _write_parquet(tmp_path / "c.parquet", [{"text": "p", "label": "1"}])
    with pytest.raises(ValueError, match=r"missing prompt column 'prompt'; columns: text, label"):
        load_prompt_file(pq_path)
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "p", "label": 1}\n{not json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not a JSON object"):
        load_prompt_file(bad)
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_prompt_file(_write_jsonl(tmp_path / "e.csv", []))
    with pytest.raises(ValueError, match="no rows"):
        load_prompt_file(_write_jsonl(tmp_path / "f.jsonl", []))
    with pytest.raises(FileNotFoundError):
        load_prompt_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="label 'label' must be a string or number, got list"):
        load_prompt_file(_write_jsonl(tmp_path / "g.jsonl", [{"prompt": "p", "label": [1]}]))
    with pytest.raises(ValueError, match="prompt must be a string or a non-empty list"):
        load_prompt_file(_write_jsonl(tmp_path / "h.jsonl", [{"prompt": [{"x": 1}], "label": "1"}]))


def test_file_task(tmp_path):
    path = _write_parquet(tmp_path / "dapo.parquet", _dapo_rows(200))
    t = get_task("math", train_path=str(path), eval_fraction=0.2)
    train, ev = t.examples("train", None), t.examples("eval", None)
    assert len(train) + len(ev) == 200 and 20 <= len(ev) <= 60
    assert not {e.uid for e in train} & {e.uid for e in ev}
    s1 = [e.uid for e in t.examples("train", 500, seed=1)]  # the train stream runs over epochs
    assert s1 == [e.uid for e in t.examples("train", 500, seed=1)]
    assert sorted(s1[: len(train)]) == sorted(e.uid for e in train)  # each epoch is a permutation
    ex = ev[0]
    assert t.reward(ex.prompt, f"...\nAnswer: {ex.label}", ex.label) == 1.0
    assert t.reward(ex.prompt, "Answer: -1", ex.label) == 0.0
    ev_path = _write_jsonl(tmp_path / "ev.jsonl", [{"prompt": "1+1?", "label": "2"}])
    t2 = FileTask(path, ev_path)
    assert len(t2) == 200 and [e.label for e in t2.examples("eval")] == ["2"]


def test_toolchain_pays_for_the_tool_and_has_long_tailed_turns():
    from rollverify.app.tiny_model import build_tokenizer
    from rollverify.app.warm_start import demonstration_batch
    from rollverify.environment.tool_calls import parse_tool_calls

    t = get_task("toolchain")
    exs = t.examples("train", 3000)
    ks = np.array([e.meta["k"] for e in exs])
    assert ks.min() == 1 and ks.max() == 8 and np.mean(ks) < 3.5 and np.percentile(ks, 99) == 8  # long tail
    assert not {e.prompt for e in exs} & {e.prompt for e in t.examples("eval", 500)}
    ex = next(e for e in exs if e.meta["k"] == 3)
    parts = t.demonstration_segments(ex)
    policy = [text for text, mine in parts if mine]
    assert len(policy) == 4 and len(parts) == 7  # 3 calls, 3 outputs, the answer line
    calls = [parse_tool_calls(text)[0] for text in policy[:3]]
    x = f"{ex.meta['head']:03d}"
    for call in calls:  # each call names the node the previous output gave
        assert call.name == "next" and call.arguments == {"x": x}
        x = t.lookup(x)
    assert x == "=" + ex.label and policy[3] == x
    assert t.reward(ex.prompt, t.demonstration(ex) + "<|endoftext|>", ex.label) == 1.0
    assert t.reward(ex.prompt, f"={ex.label}", ex.label) == 1.0  # only the answer counts; guessing it is 1/1000
    assert t.reward(ex.prompt, t.demonstration(ex)[:-1], ex.label) == 0.0
    assert t.lookup("1000") == "error: no node 1000" and t.lookup(True).startswith("error")
    tool = t.tool_registry().get("next")
    assert tool.run({"y": 1}, 1.0).error == "bad_arguments"
    # the warm start learns the policy's parts only
    tok = build_tokenizer(128)
    ids, labels = demonstration_batch(tok, t, [ex])
    env_ids = tok(parts[1][0], add_special_tokens=False)["input_ids"]
    n_policy = sum(len(tok(text, add_special_tokens=False)["input_ids"]) for text in policy) + 1  # + EOS
    assert int((labels != -100).sum()) == n_policy
    assert len(env_ids) > 10 and tok.convert_tokens_to_ids("</tool_call>") == 101


def test_retool_reads_dapo_rows_lists_the_python_tool_and_scores_the_final_turn(tmp_path):
    from rollverify.app.tiny_model import build_tokenizer
    from rollverify.tasks.chat import PromptRenderer

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} * 7?"}], "reward_model": {"ground_truth": str(7 * i)},
             "data_source": "dapo"} for i in range(40)]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = get_task("retool", train_path=str(path), memory_mib=256)
    ex = t.examples("train", 1)[0]
    assert ex.messages[0]["role"] == "system" and "python tool" in ex.messages[0]["content"]
    reg = t.tool_registry()
    assert reg.get("python") is not None and reg.get("code_interpreter") is reg.get("python")
    assert reg.get("python").sandbox.limits.memory_bytes == 256 << 20
    # a template that lists the tools, as Qwen3's does: the prompt carries the python tool's schema
    tok = build_tokenizer(128)
    tok.chat_template = ("{% if tools %}# Tools{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "<|im_start|>assistant\n")
    text = PromptRenderer(tok, True, tools=reg.schemas()).text(ex)
    assert text.startswith("# Tools python") and "<|im_start|>system\nSolve the problem" in text
    # the reward reads the policy's last turn: a tool's output cannot answer for it
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    boxed = "\\boxed{" + ex.label + "}"
    env = f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{boxed}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert t.reward(ex.prompt, call + env + "so " + boxed, ex.label) == 1.0
    assert t.reward(ex.prompt, call + env + "I do not know", ex.label) == 0.0
    assert t.reward(ex.prompt, boxed, ex.label) == 1.0  # single turn
