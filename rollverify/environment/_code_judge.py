"""The code reward's judge: runs a problem's test code, with no candidate code in it, in its own sandbox. Never
imported: it is the program of its sandbox, beside a copy of `wire.py`.

The test code's calls of the candidate (HumanEval's `candidate`, an MBPP assert's function) are stand-ins that ask
the trusted caller, which asks the box running the candidate and hands back the plain value it produced (or the
built-in exception it raised). So every assertion is evaluated here, by the test's own code and Python's own
built-in types, on values no candidate object can pose as: the candidate never shares a process with the tests.

    in:  {"prompt": src, "setup": src, "cases": [src | None, ...], "call": src | None, "remote": [name, ...],
          "per_case_s": s, "max_frame": n}
    out: {"case": i}                                           (case i begins)
    out: {"id": n, "call": name, "args": [...], "kwargs": {...}}   in: {"id": n, "value": v} | {"id": n, "error"...}
    out: {"verdict": i, "passed": bool, "error": None | text}
    out: {"done": true, "setup_error": None | text}
"""

import builtins
import importlib.util
import itertools
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wire import WireError, decode, encode, frame, read_frame, write_all  # noqa: E402

CHAN_IN, CHAN_OUT = 3, 4
_ids = itertools.count()


class CaseTimeout(Exception):
    pass


class RemoteError(Exception):
    """An exception the candidate raised that is not one of Python's built-in ones."""


def describe(exc):
    return f"{type(exc).__name__}: {exc}"[:500]


def send(message):
    write_all(CHAN_OUT, frame(message))


class Remote:
    """The candidate's function `name`, called in the box through the trusted caller."""

    def __init__(self, name):
        self.name = self.__name__ = name

    def __call__(self, *args, **kwargs):
        rid = next(_ids)
        try:
            payload = {"args": encode(list(args)), "kwargs": encode(kwargs)}
        except WireError as exc:
            raise TypeError(f"an argument of {self.name} cannot be sent to the candidate: {exc}") from None
        send({"id": rid, "call": self.name, **payload})
        reply = read_frame(CHAN_IN, SPEC["max_frame"])
        if reply is None or reply.get("id") != rid:
            raise RemoteError("the caller sent no answer")
        if "value" in reply:
            return decode(reply["value"])
        kind = getattr(builtins, str(reply.get("type")), None)
        if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
            raise kind(reply.get("error"))
        raise RemoteError(reply.get("error"))

    def __repr__(self):
        return f"<candidate {self.name}>"


def on_timer(signum, frame_):
    raise CaseTimeout(f"the test's own code ran past {SPEC['per_case_s']} s of CPU")


def run_case(index, fn):
    send({"case": index})
    signal.setitimer(signal.ITIMER_PROF, SPEC["per_case_s"])
    error = None
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - any way a case fails is its verdict
        error = describe(exc)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    send({"verdict": index, "passed": error is None, "error": error})


def main():
    global SPEC
    SPEC = read_frame(CHAN_IN, 1 << 30)
    signal.signal(signal.SIGPROF, on_timer)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__rv_case__": run_case}
    setup_error = None
    try:
        exec(compile(SPEC["prompt"], "prompt.py", "exec"), namespace)
        for name in SPEC["remote"]:
            # A test may use a module the candidate imported (MBPP's `math.isclose`): here it imports it itself.
            if name in sys.stdlib_module_names and importlib.util.find_spec(name) is not None:
                namespace[name] = __import__(name)
            else:
                namespace[name] = Remote(name)
        exec(compile(SPEC["setup"], "tests.py", "exec"), namespace)
        for i, src in enumerate(SPEC["cases"]):
            if src is not None:
                code = compile(src, f"test_{i}.py", "exec")
                run_case(i, lambda code=code: exec(code, namespace))
        if SPEC["call"] is not None:
            exec(compile(SPEC["call"], "tests_call.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001
        setup_error = describe(exc)
    send({"done": True, "setup_error": setup_error})


main()
