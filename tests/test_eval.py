"""Evaluation logic and chat prompts: pass@k, per-set metrics, eval.sets parsing, the chat template as the
policy sees it (a local tokenizer folder with a template), and the Evaluator's batch on a recording engine."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rollverify.app.config import ConfigError, load_config
from rollverify.app.evaluate import (
    EvalSet,
    Evaluator,
    build_evaluator,
    format_interval,
    format_table,
    parse_eval_sets,
    pass_at_k,
    set_metrics,
)
from rollverify.metrics import MetricsWriter
from rollverify.tasks import get_task
from rollverify.tasks.base import Example
from rollverify.tasks.chat import PromptRenderer, has_chat_template

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory, tiny_dense_path):
    """The tiny model's tokenizer saved with a Qwen-style chat template (no hub download)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chat_tok")
    tok = AutoTokenizer.from_pretrained(tiny_dense_path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def chat_tokenizer(chat_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer_dir)


MSGS = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"})
CHAT_EX = Example(uid="a", prompt="Be brief.\n\nWhat is 2+2?", label="4", messages=MSGS)
PLAIN_EX = Example(uid="b", prompt="What is 3+3?\n", label="6")


def test_pass_at_k():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_set_metrics():
    scores = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], float)
    assert set_metrics(scores, 1.0) == {"avg@4": pytest.approx(5 / 12), "pass@4": pytest.approx(2 / 3)}
    # a -1/+1 reward: solved_at decides what counts as solved
    assert set_metrics(np.array([[-1.0, 1.0]]), 1.0) == {"avg@2": 0.0, "pass@2": 1.0}


def test_eval_sets_parsing_errors():
    specs = parse_eval_sets({"aime24": "a.parquet", "math500": {"path": "m.jsonl", "prompt_key": "problem"}})
    assert [(s.name, s.path, s.prompt_key) for s in specs] == [
        ("aime24", "a.parquet", "prompt"),
        ("math500", "m.jsonl", "problem"),
    ]
    for raw, msg in [
        ({"a/b": "x"}, "set name 'a/b'"),
        ({"heldout": "x"}, "held-out split"),
        ({"a": 3}, "expected a file path or a mapping with 'path'"),
        ({"a": {"path": "x", "promptkey": "p"}}, "unknown key.*promptkey"),
        ({"a": {"path": "x", "label_key": 1}}, "a.label_key: expected a string"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_eval_sets(raw)


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.sets: aime24: prompt file .*missing.parquet does not exist"):
        load_config(None, [f"eval.sets={{aime24: {tmp_path / 'missing.parquet'}}}"])
    with pytest.raises(ConfigError, match=r"task.options.chat_template: true, but the tokenizer of the tiny model"):
        load_config(None, ["task.options.chat_template=true"])
    with pytest.raises(ConfigError, match=r"chat_template must be auto, true or false; got 'maybe'"):
        load_config(None, ["task.options.chat_template=maybe"])
    with pytest.raises(ConfigError, match=r"task.reward: 'nope' is not module:function"):
        load_config(None, ["task.reward=nope"])


# --- chat template --------------------------------------------------------------------------------------


def test_auto_applies_the_template_to_messages_only(chat_tokenizer, chat_tokenizer_dir):
    assert has_chat_template(chat_tokenizer_dir)
    r = PromptRenderer(chat_tokenizer, "auto")
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert r.text(CHAT_EX) == want
    ids = r.ids(CHAT_EX)
    assert ids == chat_tokenizer(want, add_special_tokens=False)["input_ids"]
    assert ids.count(chat_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not characters
    assert r.text(PLAIN_EX) == PLAIN_EX.prompt


def test_true_wraps_plain_prompts_and_false_never_templates(chat_tokenizer):
    assert PromptRenderer(chat_tokenizer, True).text(PLAIN_EX) == (
        "<|im_start|>user\nWhat is 3+3?\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert PromptRenderer(chat_tokenizer, False).text(CHAT_EX) == CHAT_EX.prompt


def test_no_template(tiny_dense_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense_path)
    assert not has_chat_template(tiny_dense_path)
    assert PromptRenderer(tok, "auto").text(CHAT_EX) == CHAT_EX.prompt  # auto without a template: plain text
    with pytest.raises(ValueError, match="chat_template is true but the tokenizer at .* has no chat template"):
        PromptRenderer(tok, True, source=tiny_dense_path)


def test_config_accepts_true_with_a_templated_model(chat_tokenizer_dir):
    cfg = load_config(None, [f"model.path={chat_tokenizer_dir}", "task.options.chat_template=true"])
    assert cfg.task.options["chat_template"] is True


# --- the evaluator --------------------------------------------------------------------------------------


class RecordingEngine:
    """Answers each prompt with a scripted response (the label on the first of every k copies)."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate(self, prompts, max_new_tokens, sampling, tag):
        self.calls.append((prompts, max_new_tokens, sampling, tag))
        return [np.asarray(self.tokenizer(a, add_special_tokens=False)["input_ids"], np.int32) for a in self.answers]


def _dapo_file(path, n, offset=0):
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "reward_model": {"ground_truth": str(2 * i)}}
        for i in range(offset, offset + n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_evaluator_batches_every_set_with_the_chat_template(tmp_path, chat_tokenizer, chat_tokenizer_dir):
    a = _dapo_file(tmp_path / "aime.jsonl", 2)
    b = _dapo_file(tmp_path / "amc.jsonl", 3, offset=10)
    cfg = load_config(
        None,
        [f"model.path={chat_tokenizer_dir}", "task.name=math", f"task.options={{train_path: {a}, eval_path: {b}}}",
         f"eval.sets={{aime: {a}, amc: {b}}}", "eval.n_samples=2", "eval.max_new_tokens=7", "eval.temperature=0.6"],
    )
    task = get_task(cfg.task.name, **cfg.task.options)
    ev = build_evaluator(cfg, task, chat_tokenizer, task.reward)
    labels = [x.label for s in ev.sets for x in s.examples]
    # aime: both prompts solved once in 2; amc: the first right twice, the others never
    answers = [f"Answer: {labels[0]}", "no", f"\\boxed{{{labels[1]}}}", "Answer: -1",
               f"Answer: {labels[2]}", f"Answer: {labels[2]}", "x", "x", "x", "x"]
    engine = RecordingEngine(chat_tokenizer, answers)
    m = ev.run(engine, tag="eval3")
    prompts, max_new, sampling, tag = engine.calls[0]
    assert len(engine.calls) == 1 and len(prompts) == ev.n_responses == 10
    assert (max_new, sampling.temperature, tag) == (7, 0.6, "eval3")
    renderer = PromptRenderer(chat_tokenizer, "auto")
    first = ev.sets[0].examples[0]
    assert prompts[0].tolist() == prompts[1].tolist() == renderer.ids(first)
    assert chat_tokenizer.decode(prompts[0].tolist()).startswith("<|im_start|>user\nWhat is")
    assert m == {
        "eval/aime/avg@2": 0.5, "eval/aime/pass@2": 1.0,
        "eval/amc/avg@2": pytest.approx(1 / 3), "eval/amc/pass@2": pytest.approx(1 / 3),
        "eval_reward": pytest.approx((0.5 + 1 / 3) / 2),
        # per-prompt means: aime [1/2, 1/2] (se 0), amc [1, 0, 0] (std 3^-1/2, se 1/3): sqrt(0 + 1/9) / 2 sets
        "eval_reward_se": pytest.approx(1 / 6),
    }
    assert format_interval(m["eval_reward"], m["eval_reward_se"]) == "0.417 +- 0.327 [0.090, 0.743]"
    assert format_interval(0.5, float("nan")) == "0.500"
    assert format_table(m).splitlines()[0].split() == ["aime", "avg@2", "0.5000", "pass@2", "1.0000"]
    # the metrics file, TensorBoard and the plots get them per set
    with MetricsWriter(tmp_path / "run", None) as w:
        w.write({"step": 1, **m})
        w.write({"step": 2, **{k: v / 2 for k, v in m.items()}})
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_sets_last"]["eval/aime/pass@2"] == 0.5
    assert (tmp_path / "run" / "plots" / "eval_sets.png").stat().st_size > 1000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("eval/amc/avg@2")] == pytest.approx([1 / 3, 1 / 6])


def test_evaluator_heldout_split_without_sets(chat_tokenizer):
    cfg = load_config(None, ["eval.n_prompts=3", "eval.n_samples=1"])
    task = get_task("countdown")
    ev = build_evaluator(cfg, task, chat_tokenizer, task.reward)
    assert [s.name for s in ev.sets] == ["heldout"] and len(ev.sets[0].examples) == 3
    answers = [task.demonstration(x) for x in ev.sets[0].examples]
    m = ev.run(RecordingEngine(chat_tokenizer, answers))
    assert m["eval/heldout/avg@1"] == 1.0 and m["eval_reward"] == 1.0
    assert not math.isnan(m["eval/heldout/pass@1"])
    with pytest.raises(ValueError, match="at least one set"):
        Evaluator([EvalSet("x", [])], render=list, decode=str, score=task.reward, n_samples=1,
                  temperature=1.0, max_new_tokens=1)
