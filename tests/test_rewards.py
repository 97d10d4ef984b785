"""Math reward against hand-labelled answer pairs (math-verify behind exact fast paths), and task.reward specs."""

from __future__ import annotations

import threading

import pytest

from rollverify.tasks import math as math_mod
from rollverify.tasks.math import math_equal, math_reward, normalize_answer
from rollverify.tasks.math_pairs import PAIRS
from rollverify.tasks.reward import RewardSpecError, checked_reward, load_reward


def _pid(p):
    return f"{p[0][-40:]}|{p[1]}|{p[2]}"


@pytest.mark.parametrize(("response", "label", "correct"), PAIRS, ids=[_pid(p) for p in PAIRS])
def test_labelled_pairs(response, label, correct):
    assert math_reward(response, label) == (1.0 if correct else 0.0)


def test_labelled_set_is_large_and_balanced():
    assert len(PAIRS) >= 40
    assert sum(c for _, _, c in PAIRS) >= 30 and sum(not c for _, _, c in PAIRS) >= 15


@pytest.mark.parametrize(
    ("pred", "truth", "equal"),
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("\\dfrac{\\sqrt 3}{2}", "\\frac{\\sqrt{3}}{2}", True),
        ("\\frac 12", "0.5", True),
        ("x = 5", "5", True),
        ("43", "42", False),
        ("0.33", "\\frac13", False),
        ("1,000", "1000", True),
    ],
)
def test_fast_paths_do_not_need_math_verify(monkeypatch, pred, truth, equal):
    """Plain numbers and answers equal after normalisation are decided without the symbolic checker."""

    def fail(*a):
        raise AssertionError("math-verify called on a fast-path pair")

    monkeypatch.setattr(math_mod, "_math_verify", fail)
    assert math_equal(pred, truth) is equal


def test_sqrt_normalisation():
    assert normalize_answer("\\dfrac{\\sqrt 3}{2}") == "\\frac{\\sqrt{3}}{2}"
    assert normalize_answer("\\sqrt3") == normalize_answer("\\sqrt 3") == "\\sqrt{3}"
    assert normalize_answer("\\sqrt{12}") == "\\sqrt{12}"


def test_percent_goes_to_math_verify():
    # "50\%" normalises to "50": the plain-number fast path must not reject it against 0.5 without a look
    assert math_reward("\\boxed{50\\%}", "0.5") == 1.0


def test_math_reward_off_the_main_thread():
    """math-verify's timeouts use SIGALRM, which only the main thread may set: other threads run without."""
    out = {}
    t = threading.Thread(target=lambda: out.update(ok=math_reward("\\boxed{\\sqrt8}", "2\\sqrt2")))
    t.start()
    t.join()
    assert out == {"ok": 1.0}


# --- task.reward: module:function ----------------------------------------------------------------------


def test_reward_spec_from_module_and_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, response, label):\n    return 2.0 if label in response else -1.0\n"
        "def two_args(response, label):\n    return 0.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards:score")
    assert fn("p", "it is 7", "7") == 2.0 and fn("p", "it is 8", "7") == -1.0
    by_file = load_reward(f"{tmp_path / 'my_rewards.py'}:score")
    assert by_file("p", "7", "7") == 2.0
    with pytest.raises(RewardSpecError, match=r"is not module:function; write e.g. my_rewards:score"):
        load_reward("my_rewards.score")
    with pytest.raises(RewardSpecError, match=r"cannot import module 'no_such_mod'.*PYTHONPATH"):
        load_reward("no_such_mod:score")
    with pytest.raises(RewardSpecError, match=r"file .*missing.py does not exist"):
        load_reward(f"{tmp_path / 'missing.py'}:score")
    with pytest.raises(RewardSpecError, match=r"has no 'scor'; its functions: score, two_args"):
        load_reward("my_rewards:scor")
    with pytest.raises(RewardSpecError, match=r"'NOT_CALLABLE' is a int, not a function"):
        load_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(RewardSpecError, match=r"two_args\(response, label\) cannot be called as"):
        load_reward("my_rewards:two_args")
    bad = checked_reward(lambda p, r, lab: float("nan"), "m:f")
    with pytest.raises(TypeError, match=r"task.reward m:f returned nan; it must return a finite number"):
        bad("p", "r", "l")
