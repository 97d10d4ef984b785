"""Confusion figures of a math reward on the hand-labelled answer pairs (rollverify/tasks/math_pairs.py).

    python tools/experiments/reward_confusion.py                      # the current rollverify.tasks.math.math_reward
    python tools/experiments/reward_confusion.py --module OLD_MATH.py # another version, e.g. `git show REV:rollverify/tasks/math.py`

Prints one JSON object: pairs, correct/wrong labels, TP, FN (correct answers rejected), FP (wrong answers
accepted), TN, seconds, and the pairs it got wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", default=None, help="a Python file defining math_reward(response, label)")
    a = p.parse_args(argv)
    from rollverify.tasks.math_pairs import PAIRS

    if a.module is None:
        from rollverify.tasks.math import math_reward
    else:
        spec = importlib.util.spec_from_file_location("reward_under_test", a.module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        math_reward = mod.math_reward
    t0 = time.perf_counter()
    counts = {"TP": 0, "FN": 0, "FP": 0, "TN": 0}
    misses = []
    for response, label, correct in PAIRS:
        got = math_reward(response, label) == 1.0
        counts[("T" if got == correct else "F") + ("P" if got else "N")] += 1
        if got != correct:
            misses.append({"response": response, "label": label, "correct": correct})
    print(json.dumps({
        "reward": a.module or "rollverify.tasks.math.math_reward",
        "pairs": len(PAIRS),
        "correct": sum(c for *_, c in PAIRS),
        "wrong": sum(not c for *_, c in PAIRS),
        **counts,
        "seconds": round(time.perf_counter() - t0, 3),
        "misses": misses,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
