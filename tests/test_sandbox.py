"""The sandboxed interpreter against hostile programs: each ends inside its limits with an error result, the caller
goes on, no process of the call is left (by process group, PID namespace and sandbox user), and nothing outside the
call's folder changes. Measured figures are printed (`pytest -s`) for docs/tools.md."""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

from rollverify.environment.limits import MIB, SandboxLimits, SandboxUnavailable
from rollverify.environment.procscan import alive, pids_of_user, sandbox_processes
from rollverify.environment.sandbox import Sandbox, SandboxResult, namespaces_available

pytestmark = pytest.mark.system

IS_ROOT = os.geteuid() == 0
try:
    NOBODY_UID: int | None = pwd.getpwnam("nobody").pw_uid
except KeyError:
    NOBODY_UID = None
DROPS_USER = IS_ROOT and NOBODY_UID is not None and os.access("/usr/bin/python3", os.X_OK)
HAS_NS = namespaces_available()
needs_nobody = pytest.mark.skipif(
    not DROPS_USER,
    reason="needs root, a `nobody` user and /usr/bin/python3: RLIMIT_NPROC and file permissions only hold for an "
    "unprivileged sandbox user",
)
needs_ns = pytest.mark.skipif(
    not HAS_NS, reason="unshare cannot make network/PID namespaces here (needs root)"
)


@pytest.fixture(scope="module")
def base_dir():
    """A folder the sandbox user can traverse (pytest's own tmp folders are 0700 root), empty after every call."""
    d = tempfile.mkdtemp(prefix="rv-sandbox-test-")
    os.chmod(d, 0o711)
    yield Path(d)
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture(scope="module")
def nobody_baseline():
    return set(pids_of_user(NOBODY_UID)) if NOBODY_UID is not None else set()


@pytest.fixture
def limits(base_dir):
    return SandboxLimits(
        cpu_seconds=2,
        wall_seconds=15,
        memory_bytes=256 * MIB,
        processes=8,
        file_bytes=1 * MIB,
        stdout_bytes=4096,
        stderr_bytes=4096,
        base_dir=str(base_dir),
    )


@pytest.fixture
def check_clean(base_dir, nobody_baseline):
    """Asserts that a call left no process (group, namespace, sandbox user) and no folder behind."""

    def check(result: SandboxResult) -> None:
        assert result.error is None, result.error
        assert sandbox_processes(result.process_group, result.pid_namespace) == []
        if result.isolation["user"] != "same" and NOBODY_UID is not None:
            assert set(pids_of_user(NOBODY_UID)) - nobody_baseline == set()
        assert list(base_dir.iterdir()) == [], "the call's folder was not removed"

    return check


def run(limits: SandboxLimits, code: str, **changes) -> SandboxResult:
    return Sandbox(dataclasses.replace(limits, **changes) if changes else limits).run(code)


def test_normal_code_returns_stdout_in_a_scrubbed_environment(limits, check_clean, monkeypatch, base_dir):
    monkeypatch.setenv("PYTHONPATH", "/nonexistent-leak")
    monkeypatch.setenv("RV_SECRET", "leak")
    code = "import json, os, sys\nprint(json.dumps({'cwd': os.getcwd(), 'env': dict(os.environ), 'uid': os.getuid(), 'path': sys.path}))"
    result = run(limits, code)
    assert result.ok, result.stderr
    assert result.exit_code == 0 and result.killed_by is None and not result.timed_out
    seen = json.loads(result.stdout)
    assert Path(seen["cwd"]).parent == base_dir
    assert seen["env"] == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": seen["cwd"],
        "TMPDIR": seen["cwd"],
    }
    assert not any("nonexistent-leak" in p for p in seen["path"])
    if DROPS_USER:
        assert seen["uid"] == NOBODY_UID and result.isolation["user"] == "nobody"
        assert result.isolation["python"] == "/usr/bin/python3"
    assert result.isolation["network"] == ("namespace" if HAS_NS else "none")
    print(f"\nisolation obtained: {result.isolation}; wall {result.wall_seconds:.2f} s")
    check_clean(result)


def test_errors_come_back_as_exit_code_and_stderr(limits, check_clean):
    result = run(limits, "import sys\nprint('before')\nsys.stderr.write('bad thing\\n')\nraise SystemExit(7)")
    assert (
        not result.ok
        and result.exit_code == 7
        and result.stdout == "before\n"
        and "bad thing" in result.stderr
    )
    assert result.reason() == "exit code 7"
    check_clean(result)


def test_busy_loop_is_killed_by_the_cpu_limit(limits, check_clean):
    result = run(limits, "while True:\n    pass", cpu_seconds=1, wall_seconds=60)
    assert result.killed_by in ("SIGXCPU", "SIGKILL") and not result.timed_out, result
    assert result.exit_code is None and "CPU time limit" in result.reason()
    assert result.cpu_seconds is not None and 0.5 <= result.cpu_seconds <= 2.5
    print(
        f"\nbusy loop: killed by {result.killed_by} at {result.cpu_seconds:.2f} s CPU, {result.wall_seconds:.2f} s wall"
    )
    check_clean(result)


def test_idle_runaway_is_killed_at_the_wall_limit(limits, check_clean):
    # 4 s leaves the interpreter time to start and print even on a loaded machine.
    result = run(limits, "import time\nprint('sleeping', flush=True)\ntime.sleep(1000)", wall_seconds=4.0)
    assert result.timed_out and result.killed_by == "SIGKILL" and result.exit_code is None
    assert result.stdout == "sleeping\n", "output before the time-out must be kept"
    latency = result.wall_seconds - 4.0
    assert 0 <= latency < 3.0, f"the group was killed {latency:.2f} s after the wall limit"
    print(f"\nwall time-out: call returned {latency * 1000:.0f} ms after the 4.0 s limit")
    check_clean(result)


def test_memory_bomb_is_refused_at_the_address_space_limit(limits, check_clean):
    code = (
        "import sys\nchunks = []\ntry:\n    while True:\n        chunks.append(bytearray(8 << 20))\n"
        "except MemoryError:\n    print(len(chunks) * 8)\n    sys.exit(3)\n"
    )
    result = run(limits, code, memory_bytes=128 * MIB)
    assert result.exit_code == 3, result
    refused_at_mib = int(result.stdout)
    assert 64 <= refused_at_mib <= 128, refused_at_mib
    assert result.peak_memory_bytes is not None and result.peak_memory_bytes <= 128 * MIB
    big = run(limits, "bytearray(1 << 30)", memory_bytes=128 * MIB)
    assert big.exit_code == 1 and "MemoryError" in big.stderr
    print(
        f"\nmemory bomb: refused after {refused_at_mib} MiB allocated under RLIMIT_AS 128 MiB "
        f"(peak RSS {result.peak_memory_bytes / MIB:.0f} MiB); one 1 GiB allocation refused outright"
    )
    check_clean(result)
    check_clean(big)


@needs_nobody
def test_fork_bomb_is_bounded_by_the_process_limit(limits, check_clean):
    counted = (
        "import os, time\nok = refused = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        refused += 1\n        continue\n    if pid == 0:\n        time.sleep(600)\n"
        "        os._exit(0)\n    ok += 1\nprint(ok, refused)\n"
    )
    result = run(limits, counted)
    assert result.ok, result
    forked, refused = map(int, result.stdout.split())
    # RLIMIT_NPROC 8 counts the program itself; the children sleep, so nothing but the limit stops the loop.
    assert forked <= 7 and refused >= 193, (forked, refused)
    assert result.wall_seconds < 10, (
        "the call must end when the program does, children killed, not at the limit"
    )
    # Every process forks again until refused (exponential); the first leaves at once, its descendants sleep.
    spreading = (
        "import os, time\nme = os.getpid()\nfor _ in range(50):\n    try:\n        os.fork()\n"
        "    except OSError:\n        break\nif os.getpid() != me:\n    time.sleep(600)\nprint('first left')\n"
    )
    spread = run(limits, spreading)
    assert spread.ok and spread.stdout == "first left\n", spread
    assert spread.wall_seconds < 10
    stopped_by = "PID namespace exit" if HAS_NS else "subreaper kill"
    print(
        f"\nfork bomb as nobody: {forked} forks, then {refused} refused (RLIMIT_NPROC 8); descendants: {stopped_by}"
    )
    check_clean(result)
    check_clean(spread)


def test_100mb_print_is_truncated_without_buffering_it(limits, check_clean):
    code = "import sys\nblock = b'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.buffer.write(block)\n"
    tracemalloc.start()
    try:
        result = run(limits, code, wall_seconds=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok, result
    assert result.stdout_truncated and result.stdout_bytes == 100 << 20
    assert result.stdout == "x" * 4096
    assert peak < 4 * MIB, f"the parent held {peak / MIB:.1f} MiB while reading 100 MiB"
    print(
        f"\n100 MiB print: {result.stdout_bytes} bytes read, {len(result.stdout)} kept; parent's traced peak "
        f"{peak / 1024:.0f} KiB; {result.wall_seconds:.2f} s"
    )
    check_clean(result)


def test_file_size_limit_kills_a_large_write(limits, check_clean):
    # CPython ignores SIGXFSZ, so the write past RLIMIT_FSIZE fails with EFBIG instead of killing the program.
    code = (
        "import os\ntry:\n    with open('big', 'wb') as f:\n        f.write(b'x' * (4 << 20))\n"
        "except OSError as exc:\n    print(exc.errno, os.path.getsize('big'))\n"
    )
    result = run(limits, code)
    assert result.ok and result.stdout.split() == ["27", str(1 * MIB)], result
    check_clean(result)


@needs_nobody
def test_writes_outside_the_folder_are_refused(limits, check_clean, tmp_path, base_dir):
    shared = base_dir.parent / f"rv-sandbox-root-{os.getpid()}"
    shared.mkdir(mode=0o755)
    try:
        targets = [str(shared / "owned"), str(tmp_path / "owned"), str(base_dir / "owned")]
        code = (
            "import json, os\nout = {}\n"
            f"for target in {targets!r} + ['inside']:\n"
            "    try:\n        with open(target, 'w') as f:\n            f.write('x')\n        out[target] = 'written'\n"
            "    except OSError as exc:\n        out[target] = exc.errno\n"
            "print(json.dumps(out))\n"
        )
        result = run(limits, code)
        assert result.ok, result
        seen = json.loads(result.stdout)
        assert seen["inside"] == "written", "the program must be able to write into its own folder"
        for target in targets:
            assert seen[target] != "written", target
            assert not Path(target).exists(), target
        check_clean(result)
    finally:
        subprocess.run(["rm", "-rf", str(shared)], check=False)


@needs_ns
def test_network_connections_fail_inside_the_namespace(limits, check_clean):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(5)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            listener.accept()[0].close()  # the listener does accept connections from outside the sandbox
        code = (
            "import socket, sys\ns = socket.socket()\ns.settimeout(3)\ntry:\n"
            f"    s.connect(('127.0.0.1', {port}))\nexcept OSError as exc:\n    print(exc.errno)\n    sys.exit(0)\n"
            "print('connected')\n"
        )
        result = run(limits, code)
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.ok and result.stdout.strip() == "101", result  # ENETUNREACH
    check_clean(result)


def test_killing_its_parent_spares_the_caller(limits, check_clean):
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        code = (
            "import os, signal\nppid = os.getppid()\nprint(ppid, flush=True)\n"
            "try:\n    os.kill(ppid, signal.SIGKILL)\nexcept OSError as exc:\n    print('refused', exc.errno, flush=True)\n"
            "os.killpg(0, signal.SIGKILL)\n"
        )
        result = run(limits, code, wall_seconds=5)
        assert result.error is None and result.stdout, result
        ppid = int(result.stdout.split()[0])
        assert ppid != os.getpid(), "the program's parent must be the sandbox's supervisor, never the caller"
        assert alive(os.getpid()) and canary.poll() is None, "the caller and its other children live on"
        assert result.process_group not in (os.getpgrp(), os.getpid())
        if HAS_NS and DROPS_USER:
            # kill(-1) reaches only what the user may signal inside the namespace: nothing of the caller's.
            code = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as exc:\n    print(exc.errno)\n"
            everyone = run(limits, code + "print('alive')")
            assert everyone.stdout == "3\nalive\n" and canary.poll() is None, (
                everyone
            )  # ESRCH: no one to kill
            check_clean(everyone)
        check_clean(result)
    finally:
        canary.kill()
        canary.wait()


def test_a_process_that_leaves_the_group_does_not_outlive_the_call(limits, check_clean):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('left')"
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        for ns in (True, False):
            result = run(limits, code, network_namespace=ns)
            assert result.ok and result.stdout == "left\n", result
            assert result.wall_seconds < 10, "a detached child must not hold the call until its wall limit"
            # Without a namespace of its own the clean-up must stay inside the call: others' processes live on.
            assert canary.poll() is None
            check_clean(result)
    finally:
        canary.kill()
        canary.wait()


def test_without_user_drop_or_namespaces_the_isolation_says_so(limits, check_clean):
    # Benign code only: this is the fallback in which a program may do whatever its caller may.
    result = run(limits, "import os\nprint(os.getuid())", user=None, network_namespace=False)
    assert result.ok and int(result.stdout) == os.geteuid()
    assert result.isolation == {"network": "none", "pid": "none", "user": "same", "python": sys.executable}
    assert result.pid_namespace is None
    check_clean(result)


def test_the_leftover_scan_refuses_the_callers_own_group_and_namespace():
    with pytest.raises(ValueError, match="caller's own"):
        sandbox_processes(12345, os.readlink("/proc/self/ns/pid"))
    with pytest.raises(ValueError, match="not a sandbox's"):
        sandbox_processes(os.getpgrp(), None)
    with pytest.raises(ValueError, match="not a sandbox's"):
        sandbox_processes(1, None)


def test_caller_goes_on_calling_after_hostile_runs(limits, check_clean):
    sandbox = Sandbox(limits)
    start = time.monotonic()
    results = [sandbox.run(f"print({i} * {i})") for i in (2, 3)]
    assert [r.stdout for r in results] == ["4\n", "9\n"]
    print(f"\nplain calls: {(time.monotonic() - start) / 2:.2f} s each")
    for r in results:
        check_clean(r)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("cpu_seconds", 0, "cpu_seconds"),
        ("wall_seconds", -1, "wall_seconds"),
        ("memory_bytes", 1 * MIB, "memory_bytes"),
        ("processes", 0, "processes"),
        ("stdout_bytes", "10", "stdout_bytes"),
        ("require", ("network", "gpu"), "require"),
        ("python", "python3", "absolute path"),
        ("base_dir", "/nonexistent/rv", "base_dir"),
    ],
)
def test_bad_limits_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        SandboxLimits(**{field: value})


def test_a_required_isolation_that_is_missing_refuses_to_start():
    with pytest.raises(SandboxUnavailable, match="user"):
        Sandbox(SandboxLimits(user=None, require=("user",)))
    with pytest.raises(SandboxUnavailable, match="network"):
        Sandbox(SandboxLimits(network_namespace=False, require=("network",)))
    if IS_ROOT:
        with pytest.raises(SandboxUnavailable, match="not a user"):
            Sandbox(SandboxLimits(user="rv-no-such-user"))
    if DROPS_USER:
        with tempfile.TemporaryDirectory() as private:  # 0700 root: nobody cannot reach a folder in it
            with pytest.raises(SandboxUnavailable, match="not searchable"):
                Sandbox(SandboxLimits(base_dir=private))
