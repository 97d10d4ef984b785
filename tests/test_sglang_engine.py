"""SGLang on CPU serves the tiny models: log-probs equal a float32 HF forward, MoE routes equal the HF router's
top-k, a bad model folder fails with an error that names it and leaves no process behind, and shutdown ends
every child."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import psutil
import pytest
from engine_fixtures import REGISTRY, hf_forward, hf_model, reset_server, run, same_routes

from sglang_ext.client import SubmitRequest

pytest_plugins = ["engine_fixtures"]  # the session servers, shared with the other sglang_ext tests
pytestmark = pytest.mark.engine

PROMPTS = [[5, 6, 7, 8], [20, 21, 22, 23, 24, 25], [40, 41], [60, 61, 62, 70, 71]]
TOL = 1e-4


def generate(served, requests, sampling=None):
    """Submit, wait until every response finished, return the tracked responses."""

    async def main():
        await reset_server(served)
        async with served.client(poll_wait_s=0.2) as c:
            await c.submit(requests, sampling)
            for _ in requests:
                await c.next_finished(120)
            return {r.rid: c.responses[r.rid] for r in requests}

    return run(main())


def mixed_requests(max_new_tokens=24):
    """Greedy and tempered responses in one batch (SGLang treats an all-greedy batch differently)."""
    reqs = []
    for i, p in enumerate(PROMPTS):
        for t in (0.0, 0.7):
            reqs.append(
                SubmitRequest(
                    f"p{i}-t{t}", p, max_new_tokens, sampling={"temperature": t, "ignore_eos": True}
                )
            )
    return reqs


def check_against_hf(served, responses, routes: bool):
    worst = 0.0
    for rid, r in responses.items():
        t = float(rid.split("-t")[1])
        assert len(r.token_ids) == 24 and r.finish_reason == "length"
        lp, hf_routes = hf_forward(served.model, r.prompt_ids, r.token_ids, t)
        assert r.logprobs.dtype == np.float32
        worst = max(worst, float(np.abs(lp - r.logprobs).max()))
        if t == 0.0:  # greedy picks the HF argmax, and reports log_softmax(logits) (temperature 1)
            lp_all, _ = hf_forward(served.model, r.prompt_ids, r.token_ids, 1.0)
            assert np.allclose(lp_all, r.logprobs, atol=TOL)
        assert (r.versions == 0).all()
        if routes:
            assert r.prompt_routed_experts.shape == (len(r.prompt_ids) - 1, 2, 2)
            assert r.routed_experts.shape == (len(r.token_ids), 2, 2)
            got = np.concatenate([r.prompt_routed_experts, r.routed_experts])
            assert got.shape == hf_routes.shape
            assert same_routes(got, hf_routes).all(), (
                f"{rid}: routes differ at {np.argwhere(~same_routes(got, hf_routes))[:5]}"
            )
        else:
            assert r.routed_experts is None
    assert worst <= TOL, f"max |lp_sglang - lp_hf| = {worst:.2e}"


def test_dense_logprobs_equal_hf_float32(dense_server):
    responses = generate(dense_server, mixed_requests())
    check_against_hf(dense_server, responses, routes=False)
    # greedy tokens are the HF argmax (checked through the log-probs: each chosen token is the most likely)
    import torch

    m = hf_model(str(dense_server.model))
    for rid, r in responses.items():
        if rid.endswith("t0.0"):
            ids = torch.from_numpy(np.concatenate([r.prompt_ids, r.token_ids[:-1]]).astype(np.int64))[None]
            with torch.no_grad():
                am = m(ids).logits[0, len(r.prompt_ids) - 1 :].argmax(-1).numpy()
            assert np.array_equal(am, r.token_ids)


def test_moe_logprobs_and_routes_equal_hf(moe_server):
    responses = generate(moe_server, mixed_requests())
    check_against_hf(moe_server, responses, routes=True)


# ---------------------------------------------------------------------------------------------- bad folders


def _tagged_processes(tag: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("ROLLVERIFY_TEST_TAG") == tag:
                found.append(p.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def _serve(model, tag, timeout=240):
    env = {**os.environ, "ROLLVERIFY_TEST_TAG": tag}
    return subprocess.run(
        [sys.executable, "-m", "sglang_ext.server", "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_missing_model_folder_fails_fast_naming_it(tmp_path, tiny_dense_path):
    tag = uuid.uuid4().hex
    r = _serve(tmp_path / "no-such-model", tag)
    assert r.returncode == 2 and f"model folder {tmp_path / 'no-such-model'} does not exist" in r.stderr
    bad = tmp_path / "noweights"
    shutil.copytree(tiny_dense_path, bad)
    (bad / "model.safetensors").unlink()
    r = _serve(bad, tag)
    assert r.returncode == 2 and str(bad) in r.stderr and "no weights" in r.stderr
    assert _tagged_processes(tag) == []


def test_engine_start_failure_names_folder_and_leaves_no_process(tmp_path, tiny_dense_path):
    """A folder that passes the checks but SGLang cannot build (an activation it lacks): the scheduler child
    dies while starting, the server reports the folder and ends every child it had."""
    bad = tmp_path / "unknown-activation"
    shutil.copytree(tiny_dense_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_act"] = "no_such_activation"
    (bad / "config.json").write_text(json.dumps(cfg))
    tag = uuid.uuid4().hex
    r = _serve(bad, tag)
    assert r.returncode == 3, r.stderr[-2000:]
    assert f"SGLang could not serve model folder {bad.resolve()}" in r.stderr
    deadline = time.monotonic() + 10.0  # the server has exited; give the kernel a moment to reap its children
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged_processes(tag) == [], "child processes outlived the failed start"


@pytest.mark.session_end
def test_shutdown_leaves_no_child_process(dense_server, moe_server):
    """Last in the session: the session servers shut down on command and take every child with them."""
    for served in (dense_server, moe_server):
        proc = served.proc
        kids = proc.descendants()
        assert kids, "the server should have SGLang children"

        async def stop(served=served):
            async with served.client() as c:
                await c.shutdown()

        run(stop(), 60)
        proc.proc.wait(60)
        assert proc.proc.returncode == 0, proc.log_tail()
        psutil.wait_procs([psutil.Process(p) for p in kids if psutil.pid_exists(p)], timeout=20)
        alive = [
            p for p in kids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        assert alive == [], f"children left behind: {alive}"
        REGISTRY.forget(served.kind)
