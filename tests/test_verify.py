"""two_stage_verify against the per-token reference (property-based), hand-computed cases, bad input."""

from __future__ import annotations

import math
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollverify.verify import ROW, token_ops, two_stage_verify, two_stage_verify_ops
from rollverify.verify_reference import reference_token_ops, reference_verify, reference_verify_ops

INF, NAN = math.inf, math.nan
SETTINGS = settings(max_examples=200, deadline=None)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# --- random ragged batches --------------------------------------------------------------------------------

# A response is a list of (version, run length) segments; equal neighbouring versions merge into one
# segment, and a response may be empty. Long runs cross the 64-token rows and small streaming blocks.
segment = st.tuples(st.integers(0, 3), st.one_of(st.integers(1, 3), st.integers(1, 150)))
batch_layout = st.lists(st.lists(segment, max_size=5), max_size=6)
blocks = st.sampled_from([None, 1, ROW, 2 * ROW, 1000])


def expand(layout):
    versions = [v for resp in layout for v, n in resp for _ in range(n)]
    lengths = [sum(n for _, n in resp) for resp in layout]
    return versions, lengths


special_logprob = st.sampled_from([NAN, INF, -INF, 0.0, -1e-3])


@st.composite
def logprob_batches(draw):
    versions, lengths = draw(batch_layout.map(expand))
    n = len(versions)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # bulk values; hypothesis adds the edges
    noise = draw(st.sampled_from([0.0, 0.003, 0.01, 1.0]))  # 0: new == old exactly, D = 0
    old = rng.uniform(-20, 0, n).astype(np.float32)
    new = (old + rng.normal(0, noise, n).astype(np.float32)).tolist()
    old = old.tolist()
    for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=3)) if n else []:
        (old if draw(st.booleans()) else new)[i] = draw(special_logprob)
    return old, new, versions, lengths


thresholds = st.one_of(st.sampled_from([0.0, 0.005, 0.01, 0.1, 1.0, 2.0, INF]), st.floats(0, 3))


@SETTINGS
@given(logprob_batches(), thresholds, thresholds, blocks)
def test_matches_reference_on_logprobs(batch, d_s, d_t, block):
    old, new, versions, lengths = batch
    got = two_stage_verify(
        t(old), t(new), t(versions, torch.int64), t(lengths, torch.int64), d_s, d_t, block=block
    )
    assert got.keep_lengths.dtype == torch.int64
    assert got.keep_lengths.tolist() == reference_verify(old, new, versions, lengths, d_s, d_t)


def segment_means(ops, versions, lengths):
    """Mean D of every all-finite segment (candidate exact ties for d_s)."""
    means, pos = [], 0
    for n in lengths:
        start = pos
        for j in range(pos + 1, pos + n + 1):
            if j == pos + n or versions[j] != versions[start]:
                seg = ops[start:j]
                if all(math.isfinite(x) for x in seg):
                    means.append(sum(seg) / len(seg))
                start = j
        pos += n
    return means


@st.composite
def ops_batches(draw):
    """D on a 1/64 grid (sums and means are exact in float32 and float64), thresholds often tied."""
    versions, lengths = draw(batch_layout.map(expand))
    n = len(versions)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ops = (rng.integers(0, draw(st.sampled_from([1, 4, 200])), n) / 64).tolist()
    for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=2)) if n else []:
        ops[i] = draw(st.sampled_from([INF, NAN]))
    ties = [x for x in ops if math.isfinite(x)] + segment_means(ops, versions, lengths)
    pick = st.sampled_from(ties) if ties else st.just(0.0)
    d_s = draw(st.one_of(pick, thresholds))
    d_t = draw(st.one_of(pick, thresholds))
    return ops, versions, lengths, d_s, d_t


@SETTINGS
@given(ops_batches(), blocks)
def test_matches_reference_on_ops_with_exact_ties(batch, block):
    ops, versions, lengths, d_s, d_t = batch
    got = two_stage_verify_ops(t(ops), t(versions, torch.int64), t(lengths, torch.int64), d_s, d_t, block=block)
    assert got.keep_lengths.tolist() == reference_verify_ops(ops, versions, lengths, d_s, d_t)


@settings(max_examples=50, deadline=None)
@given(logprob_batches())
def test_statistics_match_naive(batch):
    old, new, versions, lengths = batch
    r = two_stage_verify(t(old), t(new), t(versions, torch.int64), t(lengths, torch.int64))
    d = [reference_token_ops(o, w) for o, w in zip(old, new, strict=True)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    expect_resp = [np.mean(d[a:b]) if b > a else NAN for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    np.testing.assert_allclose(r.response_mean_ops.numpy(), expect_resp, rtol=1e-5, atol=1e-6)
    for s, n, resp, v, m in zip(
        *(x.tolist() for x in (r.segment_starts, r.segment_lengths, r.segment_response, r.segment_versions,
                               r.segment_mean_ops)),
        strict=True,
    ):
        assert offsets[resp] <= s and s + n <= offsets[resp + 1]
        assert set(versions[s : s + n]) == {v}
        assert s == offsets[resp] or versions[s - 1] != v
        np.testing.assert_allclose(m, np.mean(d[s : s + n]), rtol=1e-5, atol=1e-6)
    assert int(r.segment_lengths.sum()) == len(versions)
    assert r.verified_tokens == len(versions)
    assert r.kept_tokens == int(r.keep_lengths.sum())
    assert (r.keep_lengths <= r.seq_keep_lengths).all() and (r.seq_keep_lengths <= r.lengths).all()


# --- token OPS --------------------------------------------------------------------------------------------


def test_token_ops_values():
    old = t([-1.0, -1.0, -2.0, -1.0, NAN, -1.0, INF, -1.0])
    new = t([-1.0, -1.0 + math.log(1.5), -1.0, -INF, -1.0, NAN, -1.0, INF])
    d = token_ops(old, new).tolist()
    assert d[0] == 0.0
    assert d[1] == pytest.approx(0.5, rel=1e-6)
    assert d[2] == pytest.approx(math.e - 1, rel=1e-6)
    assert d[3:] == [INF] * 5  # new = -inf is not |0 - 1| = 1: a non-finite input fails every check


def test_token_ops_within_an_ulp_of_the_exact_value_also_where_d_is_small():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(20_000, generator=g) * 10
    new = old + torch.randn(20_000, generator=g) * torch.tensor([1.0, 1e-3]).repeat(10_000)
    exact = torch.expm1((new - old).double()).abs()  # of the float32 difference token_ops takes
    d = token_ops(old, new)
    assert float(((d.double() - exact).abs() / torch.from_numpy(np.spacing(d.numpy())).double()).max()) <= 1.0


def test_series_ops_within_two_ulps_of_token_ops_in_range_and_inf_outside():
    """The compiled kernel's D: |expm1| by its Taylor series where |x| <= SERIES_RANGE, inf elsewhere."""
    from rollverify.verify import SERIES_RANGE, series_ops

    x = torch.cat([torch.linspace(-SERIES_RANGE, SERIES_RANGE, 200_001), torch.logspace(-30, -0.31, 2000)])
    old = torch.full_like(x, -3.0)
    new = old + x
    exact = token_ops(old, new)
    series = series_ops(old, new)
    ulp = torch.from_numpy(np.spacing(exact.numpy()))
    assert float(((series - exact).abs() / ulp).max()) <= 2.0
    edge = torch.tensor([SERIES_RANGE + 1e-3, -SERIES_RANGE - 1e-3, 5.0, INF, -INF, NAN])
    assert series_ops(torch.zeros(6), edge).tolist() == [INF] * 6


def test_token_ops_accepts_bf16_and_float64():
    old, new = t([-1.0, -2.0]), t([-1.5, -2.0])
    ref = token_ops(old, new)
    assert token_ops(old.double(), new.double()).dtype == torch.float32
    torch.testing.assert_close(token_ops(old.bfloat16(), new.bfloat16()), ref, rtol=1e-2, atol=1e-2)


# --- hand-computed cases ----------------------------------------------------------------------------------


def ops_case(ops, versions, lengths, d_s, d_t):
    return two_stage_verify_ops(t(ops), t(versions, torch.int64), t(lengths, torch.int64), d_s, d_t)


def test_sequence_stage_cuts_at_first_drifted_segment():
    # Response 0: segments v0 [0.0, 0.0] mean 0, v1 [0.5, 0.5] mean 0.5 -> cut at 2.
    # Response 1: v1 [0.25] mean 0.25 >= 0.25 (tie) -> cut at 0.
    # Response 2: v2 [0.0, 0.75, 0.0] mean 0.25 -> 0.25 < 0.3 kept.
    r = ops_case([0, 0, 0.5, 0.5, 0.25, 0, 0.75, 0], [0, 0, 1, 1, 1, 2, 2, 2], [4, 1, 3], 0.25, INF)
    assert r.keep_lengths.tolist() == [2, 0, 0]
    r = ops_case([0, 0, 0.5, 0.5, 0.25, 0, 0.75, 0], [0, 0, 1, 1, 1, 2, 2, 2], [4, 1, 3], 0.3, INF)
    assert r.keep_lengths.tolist() == [2, 1, 3]
    assert r.segment_mean_ops.tolist() == [0.0, 0.5, 0.25, 0.25]
    assert r.segment_response.tolist() == [0, 0, 1, 2]
    assert r.segment_versions.tolist() == [0, 1, 1, 2]


def test_token_stage_only_scans_the_sequence_stage_prefix():
    ops = [0.0, 0.5, 2.0, 0.0, 3.0, 0.0]
    # d_t = 2 -> first token >= 2 is index 2 (tie).
    assert ops_case(ops, [0] * 6, [6], INF, 2.0).keep_lengths.tolist() == [2]
    # The sequence stage cuts segment v1 (tokens 3..5, mean 1.0); the token at 4 (D = 3) is never scanned.
    assert ops_case(ops, [0, 0, 0, 1, 1, 1], [6], 0.9, 2.5).keep_lengths.tolist() == [3]
    assert ops_case(ops, [0, 0, 0, 1, 1, 1], [6], 0.9, 2.0).keep_lengths.tolist() == [2]
    # Segment v0 = [0, 0.5, 2.0] has mean 0.833 >= 0.8: cut at 0, token stage has nothing left.
    r = ops_case(ops, [0, 0, 0, 1, 1, 1], [6], 0.8, 2.0)
    assert r.seq_keep_lengths.tolist() == [0] and r.keep_lengths.tolist() == [0]


def test_nan_fails_every_enabled_check_but_not_a_disabled_one():
    assert ops_case([INF, 0.0], [0, 0], [2], 3e38, INF).keep_lengths.tolist() == [0]  # inf stays inf
    ops = [0.0, NAN, 0.0]
    assert ops_case(ops, [0, 0, 0], [3], INF, INF).keep_lengths.tolist() == [3]
    assert ops_case(ops, [0, 0, 0], [3], INF, 1e30).keep_lengths.tolist() == [1]
    assert ops_case(ops, [0, 0, 0], [3], 1e30, INF).keep_lengths.tolist() == [0]
    assert ops_case(ops, [0, 1, 0], [3], 1e30, INF).keep_lengths.tolist() == [1]


def test_segments_do_not_merge_across_responses_and_empty_responses_are_fine():
    r = ops_case([0.0, 0.0, 1.0], [5, 5, 5], [0, 2, 0, 1, 0], 0.5, INF)
    assert r.keep_lengths.tolist() == [0, 2, 0, 0, 0]
    assert r.segment_starts.tolist() == [0, 2] and r.segment_response.tolist() == [1, 3]
    assert math.isnan(r.response_mean_ops[0]) and r.response_mean_ops[3] == 1.0
    assert r.acceptance_rate == pytest.approx(2 / 3) and r.kept_whole_rate == pytest.approx(4 / 5)


def test_no_tokens_at_all():
    r = two_stage_verify(t([]), t([]), t([], torch.int64), t([0, 0], torch.int64))
    assert r.keep_lengths.tolist() == [0, 0] and r.acceptance_rate == 1.0
    r = two_stage_verify(t([]), t([]), t([], torch.int64), t([], torch.int64))
    assert r.keep_lengths.tolist() == [] and r.kept_whole_rate == 1.0


def test_float32_rounding_of_threshold_is_exact():
    # D = float32(0.1) is slightly above 0.1: D >= 0.1 holds, and D >= the next double above D does not.
    d32 = float(np.float32(0.1))
    assert ops_case([d32], [0], [1], INF, 0.1).keep_lengths.tolist() == [0]
    assert ops_case([d32], [0], [1], INF, np.nextafter(d32, 1.0)).keep_lengths.tolist() == [1]


def test_long_batch_crossing_many_blocks():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 3000, (20,), generator=g)
    n = int(lengths.sum())
    old = -torch.rand(n, generator=g) * 5
    new = old + torch.randn(n, generator=g) * 0.02
    versions = torch.arange(n) // 700
    expect = reference_verify(old.tolist(), new.tolist(), versions.tolist(), lengths.tolist(), 0.01, 0.05)
    for block in (ROW, 1000, 4096, None):
        got = two_stage_verify(old, new, versions, lengths, 0.01, 0.05, block=block).keep_lengths
        assert got.tolist() == expect


def _large_batch(seed: int):
    """~40K tokens (not a whole number of rows) in 30 responses of 1-3 versions, NaN and +-inf log-probs
    placed in a few tokens, one token drifted hard."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2700, (30,), generator=g)
    n = int(lengths.sum())
    old = -torch.rand(n, generator=g) * 5
    new = old + torch.randn(n, generator=g) * 0.01
    versions = torch.cat([torch.randint(0, 3, (1,), generator=g).expand(int(k)) for k in lengths])
    versions = versions + (torch.arange(n) % 997 == 0).cumsum(0)  # version changes inside responses
    new[[7, 9000, n - 1]] = torch.tensor([-INF, NAN, INF])
    old[[20000, 20001]] = torch.tensor([NAN, -INF])
    new[30000] = old[30000] + 1.5
    return old, new, versions, lengths


@pytest.mark.system  # torch.compile: a C++ build of the kernel (~20 s here)
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="torch.compile needs a C++ compiler")
def test_compiled_row_sums_give_the_eager_results(monkeypatch):
    """Above FUSED_MIN_TOKENS a CPU batch's rows are summed by a compiled kernel: the cuts, the segments and
    their statistics are those of the eager blocks and of the reference, on both entry points and with the
    non-finite log-probs mapped to inf as the eager pass maps them (a warning would mean it fell back)."""
    import rollverify.verify as verify

    monkeypatch.setattr(verify, "_COMPILED", {})
    old, new, versions, lengths = _large_batch(3)
    d = token_ops(old, new)
    d_t = float(d[30000])  # exactly one token's D: found only if its row's sum is >= it
    cases = [(two_stage_verify, (old, new)), (two_stage_verify_ops, (d,))]
    for fn, inputs in cases:
        monkeypatch.setattr(verify, "FUSED_MIN_TOKENS", 1 << 40)
        eager = fn(*inputs, versions, lengths, 0.01, d_t)
        monkeypatch.setattr(verify, "FUSED_MIN_TOKENS", 0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fused = fn(*inputs, versions, lengths, 0.01, d_t)
        for field in ("keep_lengths", "seq_keep_lengths", "segment_starts", "segment_versions"):
            assert torch.equal(getattr(fused, field), getattr(eager, field)), field
        torch.testing.assert_close(fused.segment_mean_ops, eager.segment_mean_ops, rtol=1e-5, atol=1e-7)
        assert fused.keep_lengths.tolist() == reference_verify(
            old.tolist(), new.tolist(), versions.tolist(), lengths.tolist(), 0.01, d_t
        )
    assert len(verify._COMPILED) == 2 and None not in verify._COMPILED.values()


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="torch.compile needs a C++ compiler")
def test_a_token_at_d_t_is_found_where_the_kernel_rounds_its_d_below_token_ops(monkeypatch):
    """The kernel's D may be an ulp or two below token_ops': a row holding one token with D = d_t, the rest 0,
    then sums below d_t, and the token stage must still search that row."""
    import rollverify.verify as verify

    monkeypatch.setattr(verify, "FUSED_MIN_TOKENS", 0)
    x = torch.linspace(0.01, verify.SERIES_RANGE, 4096)  # one candidate difference per row, in column 0
    old = torch.full((x.numel() * ROW,), -2.0)
    new = old.clone()
    new[::ROW] += x
    row_sums = torch.empty(x.numel())
    verify._compiled_row_sums(verify._Source((old, new), token_ops, verify.series_ops), old.numel(), row_sums)
    below = torch.nonzero(row_sums < token_ops(old[::ROW], new[::ROW])).squeeze(1)
    assert below.numel(), "no difference the kernel rounds below token_ops: the case is not exercised"
    r = int(below[0])
    d_t = float(token_ops(old[r * ROW : r * ROW + 1], new[r * ROW : r * ROW + 1]))
    one = torch.full((3 * ROW,), -2.0)
    new1 = one.clone()
    new1[ROW + 5] += x[r]
    got = two_stage_verify(one, new1, torch.zeros(3 * ROW, dtype=torch.int64), [3 * ROW], math.inf, d_t)
    assert got.keep_lengths.tolist() == [ROW + 5]


def test_compiled_row_sums_fall_back_to_the_eager_blocks_with_a_warning(monkeypatch):
    import rollverify.verify as verify

    def no_compiler(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(verify, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", no_compiler)
    old, new, versions, lengths = _large_batch(4)
    expect = reference_verify(old.tolist(), new.tolist(), versions.tolist(), lengths.tolist(), 0.01, 2.0)
    monkeypatch.setattr(verify, "FUSED_MIN_TOKENS", 0)
    with pytest.warns(UserWarning, match="without its compiled pass .*no C\\+\\+ compiler"):
        assert two_stage_verify(old, new, versions, lengths).keep_lengths.tolist() == expect
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next batch goes straight to the eager blocks
        assert two_stage_verify(old, new, versions, lengths).keep_lengths.tolist() == expect


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(0, 2000, (64,), generator=g)
    n = int(lengths.sum())
    old = -torch.rand(n, generator=g) * 5
    new = old + torch.randn(n, generator=g) * 0.02
    versions = torch.arange(n) // 500
    cpu = two_stage_verify(old, new, versions, lengths, 0.01, 0.05)
    gpu = two_stage_verify(old.cuda(), new.cuda(), versions.cuda(), lengths.cuda(), 0.01, 0.05)
    assert gpu.keep_lengths.device.type == "cuda"
    assert torch.equal(gpu.keep_lengths.cpu(), cpu.keep_lengths)


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"new_logprobs": t([-1.0, -1.0])}, "new_logprobs must be a float tensor shaped like"),
        ({"old_logprobs": t([[-1.0, -1.0, -1.0]])}, "old_logprobs must be a 1-D float tensor"),
        ({"old_logprobs": t([1, 2, 3], torch.int64)}, "old_logprobs must be a 1-D float tensor"),
        ({"versions": t([0.0, 0.0, 1.0])}, "versions must be a 1-D integer tensor"),
        ({"versions": t([0, 1], torch.int64)}, "versions must be a 1-D integer tensor"),
        ({"lengths": t([4, -1], torch.int64)}, "lengths must be >= 0"),
        ({"lengths": t([1, 1], torch.int64)}, "lengths must sum to the number of tokens N=3"),
        ({"lengths": t([1.0, 2.0])}, "lengths must be a 1-D integer tensor"),
        ({"d_s": -0.1}, "d_s must be a number >= 0"),
        ({"d_t": NAN}, "d_t must be a number >= 0"),
        ({"d_t": "2"}, "d_t must be a number >= 0"),
        ({"old_logprobs": [-1.0, -1.0, -1.0]}, "old_logprobs must be a torch.Tensor or numpy array"),
        ({"block": 0}, "block must be a positive number"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    args = {
        "old_logprobs": t([-1.0, -1.0, -1.0]),
        "new_logprobs": t([-1.0, -1.0, -1.0]),
        "versions": t([0, 0, 1], torch.int64),
        "lengths": t([2, 1], torch.int64),
        "d_s": 0.01,
        "d_t": 2.0,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        two_stage_verify(**args)


def test_bad_ops_input():
    with pytest.raises(ValueError, match="ops must be >= 0"):
        two_stage_verify_ops(t([0.1, -0.1]), t([0, 0], torch.int64), t([2], torch.int64))
    with pytest.raises(ValueError, match="ops must be a 1-D float tensor"):
        two_stage_verify_ops(t([1, 2], torch.int64), t([0, 0], torch.int64), t([2], torch.int64))


def test_numpy_inputs_and_list_lengths_work():
    r = two_stage_verify(
        np.array([-1.0, -1.0], np.float32), np.array([-1.0, 5.0], np.float32), np.array([3, 3]), [1, 1]
    )
    assert r.keep_lengths.tolist() == [1, 0]


def test_bench_tool_runs_small(tmp_path, monkeypatch, capsys):
    import json
    import runpy
    from pathlib import Path

    out = tmp_path / "bench.json"
    argv = ["bench_verify.py", "--responses", "16", "--mean-len", "300", "--max-len", "1000", "--repeats", "2",
            "--ref-tokens", "2000", "--profile", "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(Path(__file__).parents[1] / "tools" / "bench_verify.py"), run_name="__main__")
    report = json.loads(out.read_text())
    assert report["reference_agrees_on_subsample"] and report["responses"] == 16
    assert {"verify_s_min", "floor_s_min", "x_floor", "x_faster_than_reference", "x_floor_cpu"} <= report.keys()
    assert any("expm1" in row["op"] for row in report["profile"])  # the exponential of D is one of the operations
    assert "memory floor" in capsys.readouterr().out
