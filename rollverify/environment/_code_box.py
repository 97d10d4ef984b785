"""The code reward's box: runs a candidate program in the sandbox and answers what it produced.

Never imported: it is the program of its sandbox, beside a copy of `wire.py`. It reads frames on descriptor 3 and
writes frames on 4:

    in:  {"mode": "call"|"stdio", "program": src, "per_case_s": s, "wall_factor": k, "max_frame": n,
          "max_output": n}
    out: {"ready": true, "error": None | "Type: message"}          (the program compiled and, in call mode, ran)
    in:  {"case": i}                                                (a new test case: a fresh process serves it)
    in:  {"id": n, "call": name, "method": None | name, "args": [...], "kwargs": {...}}    (call mode)
    out: {"id": n, "value": v} | {"id": n, "error": "Type: message", "type": "Type"}
    in:  {"id": n, "stdin": text}                                   (stdio mode: the program run on that input)
    out: {"id": n, "stdout": text, "exit": code, "truncated": bool}

The box never sees a test's expected output or its assertions: only the program and the inputs. Whatever the
program does in here (patch this file's functions, write frames of its own, exit) can change only what the box
claims the program produced; the trusted side compares that with what it alone knows.

Each case runs in a process forked for it from the loaded program, so one case's exit, crash, state or endless
loop ends that case only: its CPU time (an interval timer raising CaseTimeout) and its wall time (the server kills
it) are bounded per case.
"""

import io
import os
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wire import HEADER, decode, encode, frame, read_frame, write_all  # noqa: E402

CHAN_IN, CHAN_OUT = 3, 4


class CaseTimeout(Exception):
    pass


def describe(exc):
    return f"{type(exc).__name__}: {exc}"[:500]


def on_timer(signum, frame_):
    raise CaseTimeout(f"test case ran past {SPEC['per_case_s']} s of CPU")


def arm(seconds):
    signal.setitimer(signal.ITIMER_PROF, seconds)


def reply_frame(message):
    data = frame(message)
    if len(data) > SPEC["max_frame"]:
        data = frame({"id": message["id"], "error": "ValueError: the result is too large to return",
                      "type": "ValueError"})
    return data


# --- call mode: the program's functions, one forked process per case -------------------------------------------


def serve_calls(rfd, wfd, namespace):
    """In a case's process: answer calls on rfd with replies on wfd, under the case's CPU budget."""
    signal.signal(signal.SIGPROF, on_timer)
    arm(SPEC["per_case_s"])
    while True:
        request = read_frame(rfd, SPEC["max_frame"])
        if request is None:
            os._exit(0)
        try:
            target = namespace[request["call"]]
            if request.get("method") is not None:
                target = getattr(target(), request["method"])
            value = target(*decode(request["args"]), **decode(request["kwargs"]))
            message = {"id": request["id"], "value": encode(value)}
        except BaseException as exc:  # noqa: BLE001 - every way a call ends is its answer
            message = {"id": request["id"], "error": describe(exc), "type": type(exc).__name__}
        write_all(wfd, reply_frame(message))


class Case:
    """The process serving one case, its pipes, and the wall time it has used."""

    def __init__(self, index, namespace):
        self.index, self.used, self.dead = index, 0.0, None
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.req_w)
            os.close(self.rep_r)
            os.close(CHAN_IN)
            os.close(CHAN_OUT)
            serve_calls(req_r, rep_w, namespace)
        os.close(req_r)
        os.close(rep_w)

    def ask(self, request):
        """The case process's reply frame (bytes) to `request`, or None with `dead` set."""
        budget = SPEC["wall_factor"] * SPEC["per_case_s"] - self.used
        start = time.monotonic()
        try:
            write_all(self.req_w, frame(request))
            data = self._read_reply(start + max(budget, 0.0))
        except OSError:
            data = None
        self.used += time.monotonic() - start
        if data is None and self.dead is None:
            self.dead = self._ended()
        return data

    def _read_reply(self, deadline):
        buf = b""
        while True:
            if len(buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(buf)
                if size > SPEC["max_frame"]:
                    return None
                if len(buf) >= HEADER.size + size:
                    return buf[: HEADER.size + size]
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                self.dead = (f"CaseTimeout: test case ran past {SPEC['wall_factor'] * SPEC['per_case_s']:g} s "
                             "of wall time")
                return None
            ready, _, _ = select.select([self.rep_r], [], [], left)
            if ready:
                chunk = os.read(self.rep_r, 1 << 16)
                if not chunk:
                    return None
                buf += chunk

    def _ended(self):
        """Why the case's process stopped answering (it is reaped here)."""
        if self.pid is None:
            return "CaseCrash: the case's process ended"
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            status = None
        self.pid = None
        if status is None:
            return "CaseCrash: the case's process ended"
        if os.WIFSIGNALED(status):
            return f"CaseCrash: the case's process was killed by signal {os.WTERMSIG(status)}"
        return f"CaseCrash: the case's process exited with code {os.WEXITSTATUS(status)}"

    def kill(self):
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (OSError, ChildProcessError):
                pass
            self.pid = None

    def close(self):
        self.kill()
        for fd in (self.req_w, self.rep_r):
            try:
                os.close(fd)
            except OSError:
                pass


# --- stdio mode: the program run afresh on each input -----------------------------------------------------------


def run_script(code, stdin_text):
    """Fork, run the program as __main__ on `stdin_text`; its stdout (capped), exit code and whether cut."""
    data = stdin_text.encode("utf-8")
    in_fd = os.memfd_create("stdin")
    write_all(in_fd, data)
    os.lseek(in_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(in_fd, 0)
        os.dup2(out_w, 1)
        for fd in (in_fd, out_r, out_w, CHAN_IN, CHAN_OUT):
            os.close(fd)
        signal.signal(signal.SIGPROF, on_timer)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=False)
        code_ = 0
        arm(SPEC["per_case_s"])
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as exc:
            code_ = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the script's error is its exit code and traceback
            import traceback

            traceback.print_exc()
            code_ = 1
        try:
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code_ & 0xFF)
    os.close(in_fd)
    os.close(out_w)
    out, truncated = bytearray(), False
    deadline = time.monotonic() + SPEC["wall_factor"] * SPEC["per_case_s"]
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([out_r], [], [], left)
        if not ready:
            continue
        chunk = os.read(out_r, 1 << 16)
        if not chunk:
            break
        room = SPEC["max_output"] - len(out)
        if len(chunk) > room:
            truncated = True
        out += chunk[: max(room, 0)]
    os.close(out_r)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return None, "CaseTimeout: test case ran past its wall time", truncated
    if os.WIFSIGNALED(status):
        exit_code = -os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
    return bytes(out).decode("utf-8", errors="replace"), exit_code, truncated


# --- the server --------------------------------------------------------------------------------------------------


def load(spec):
    """The program compiled and, in call mode, run once; (namespace or code, error)."""
    try:
        code = compile(spec["program"], "solution.py", "exec")
    except BaseException as exc:  # noqa: BLE001
        return None, describe(exc)
    if spec["mode"] == "stdio":
        return code, None
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    signal.signal(signal.SIGPROF, on_timer)
    signal.signal(signal.SIGALRM, on_timer)
    signal.setitimer(signal.ITIMER_REAL, spec["wall_factor"] * spec["per_case_s"])
    arm(spec["per_case_s"])
    try:
        exec(code, namespace)
        error = None
    except BaseException as exc:  # noqa: BLE001
        error = describe(exc)
    finally:
        arm(0)
        signal.setitimer(signal.ITIMER_REAL, 0)
    return namespace, error


def main():
    global SPEC
    SPEC = read_frame(CHAN_IN, 1 << 30)
    loaded, error = load(SPEC)
    write_all(CHAN_OUT, frame({"ready": True, "error": error}))
    case, index = None, 0
    while True:
        request = read_frame(CHAN_IN, SPEC["max_frame"])
        if request is None:
            break
        if "case" in request:
            if case is not None:
                case.close()
            case = None
            index = request["case"]
            continue
        rid = request["id"]
        if error is not None:
            reply = {"id": rid, "error": f"the program did not load: {error}", "type": "LoadError"}
        elif SPEC["mode"] == "stdio":
            out, code, truncated = run_script(loaded, request["stdin"])
            if out is None:
                reply = {"id": rid, "error": code, "type": "CaseTimeout"}
            else:
                reply = {"id": rid, "stdout": out, "exit": code, "truncated": truncated}
        else:
            if case is None:
                case = Case(index, loaded)
            data = None if case.dead else case.ask(request)
            if data is not None:
                write_all(CHAN_OUT, data)
                continue
            kind = case.dead.split(":", 1)[0]
            reply = {"id": rid, "error": case.dead, "type": kind}
        write_all(CHAN_OUT, reply_frame(reply))
    if case is not None:
        case.close()
    os._exit(0)


main()
