"""Math reward: extract the final answer (``\\boxed{...}`` or an ``Answer:`` line) and compare it with the label.

DAPO-Math's prompts ask for a last line ``Answer: $Answer``; most other math RL data asks for ``\\boxed{}``.
Whichever of the two appears last in the response is the answer (math-verify alone takes the first of several
boxes, so extraction stays here). Comparison has two exact fast paths and one symbolic path:

- equal after normalising LaTeX noise (``$``, ``\\left``, ``\\dfrac``, ``\\text{}``, units, thousands separators,
  ``\\sqrt 3`` -> ``\\sqrt{3}``): correct;
- both sides plain decimal numbers: correct exactly when they are equal as rationals;
- anything else goes to math-verify (the parser and checker verl, slime and OpenRLHF use), which compares the
  two answers as sympy expressions: ``\\sqrt8`` = ``2\\sqrt2``, ``1/\\sqrt2`` = ``\\frac{\\sqrt2}{2}``, sets in any
  order, ``\\text{(B)}`` = ``B``, intervals, percentages.

A response without a box or an ``Answer:`` line scores 0: a number somewhere in the reasoning is not an answer.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]*)")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_REMOVE = (
    "\\displaystyle", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^{\\circ}", "^\\circ", "\\circ",
    "\\%", "%", "°", "$",
)  # fmt: skip
_NUM_WITH_UNIT = re.compile(r"(-?[\d.,]+(?:/\d+)?)\s*[a-zA-Z][a-zA-Z ]*")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_SLASH = re.compile(r"^(-?[\d.]+)/(-?[\d.]+)$")


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """(position, content) of every ``\\boxed{...}`` with balanced braces, and of ``\\boxed 5``."""
    out = []
    for m in _BOX.finditer(text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        out.append((m.start(), text[i + 1 : j]))
                        break
                j += 1
        else:
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                out.append((m.start(), tok.group(0)))
    return out


def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` content or ``Answer:`` line of `text`, or None when it has neither."""
    cands = _boxed_spans(text)
    cands += [(m.start(), m.group(1)) for m in _ANSWER_LINE.finditer(text)]
    if not cands:
        return None
    pos, ans = max(cands, key=lambda c: c[0])
    inner = _boxed_spans(ans)  # "Answer: \boxed{5}" -> "5"
    return (inner[-1][1] if inner else ans).strip()


def normalize_answer(ans: str) -> str:
    """A canonical string for comparison; see the module docstring for what is dropped."""
    s = ans.strip()
    inner = _boxed_spans(s)
    if inner:
        s = inner[-1][1]
    for _ in range(3):
        s = _TEXT_WRAPPERS.sub(r"\1", s)
    for r in _REMOVE:
        s = s.replace(r, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*([0-9a-zA-Z])", r"\\sqrt{\1}", s)  # \sqrt3, \sqrt 3 -> \sqrt{3}
    s = s.strip()
    if s.count("=") == 1 and re.fullmatch(r"\s*[a-zA-Z]\w?\s*", s.split("=")[0]):
        s = s.split("=")[1]  # "x = 5" -> "5"
    s = s.strip().rstrip(".").strip()
    m = _NUM_WITH_UNIT.fullmatch(s)
    if m:
        s = m.group(1)  # "5 dollars" -> "5"
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += c == "{"
        depth -= c == "}"
        if depth < 0:
            return False
    return depth == 0


def _as_fraction(s: str) -> Fraction | None:
    try:
        if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", s):
            return Fraction(s)
        m = _FRAC.match(s)
        if m:
            v = Fraction(m.group(2)) / Fraction(m.group(3))
            return -v if m.group(1) else v
        m = _SLASH.match(s)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return None


_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+"
_PLAIN_NUMBER = re.compile(rf"-?(?:{_NUM}|(?:{_NUM})/(?:{_NUM})|\\[dt]?frac(?:\{{-?(?:{_NUM})\}}){{2}}|\\[dt]?frac\d\d)")


def _plain_number(raw: str) -> bool:
    """A bare decimal number or fraction of them (``$`` and spaces aside): a rational that math-verify could
    not read differently (unlike ``50\\%`` or ``5 \\text{cm}``, whose normalised forms drop something)."""
    return _PLAIN_NUMBER.fullmatch(re.sub(r"[\s$]", "", raw).rstrip(".")) is not None


def _math_verify(pred: str, truth: str) -> bool:
    """math-verify on two extracted answers, each read as the content of a box.

    Its timeouts use SIGALRM, which only the main thread may set; elsewhere it runs without one.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{truth}}}", [LatexExtractionConfig()], parsing_timeout=timeout)
    got = parse(
        f"\\boxed{{{pred}}}", [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout
    )
    if not gold or not got:
        return False
    return bool(verify(gold, got, timeout_seconds=timeout))


def math_equal(pred: str, truth: str) -> bool:
    """Whether answer `pred` equals label `truth`: the exact fast paths, else math-verify (module docstring)."""
    a, b = normalize_answer(pred), normalize_answer(truth)
    if not a or not b:
        return False
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None and (fa == fb or (_plain_number(pred) and _plain_number(truth))):
        return fa == fb
    return _math_verify(pred, truth)


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer equals `label`, else 0.0 (also when it has no answer)."""
    ans = extract_answer(response)
    return 1.0 if ans is not None and math_equal(ans, str(label)) else 0.0
