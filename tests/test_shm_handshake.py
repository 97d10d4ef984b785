"""sglang_ext.cpu_compat.retry_shm_handshake: a shared-memory rebuild whose torch_shm_manager handshake times out
(libshm waits 1 s, which a loaded 2-core machine sometimes misses; it killed a server's scheduler mid weight
update) is tried again; any other error is not; a payload pickled after the patch still rebuilds."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.multiprocessing import reductions

from sglang_ext import cpu_compat


@pytest.fixture
def fake_rebuild(monkeypatch):
    """`reductions.rebuild_storage_filename` replaced by one that fails as told, then patched by the layer."""
    calls: list[int] = []
    errors: list[BaseException] = []

    def rebuild_storage_filename(*args):
        calls.append(len(calls))
        if errors:
            raise errors.pop(0)
        return "storage"

    rebuild_storage_filename.__module__ = reductions.__name__
    monkeypatch.setattr(reductions, "rebuild_storage_filename", rebuild_storage_filename)
    monkeypatch.setattr(cpu_compat.time, "sleep", lambda s: None)
    cpu_compat.retry_shm_handshake()
    return calls, errors


def test_a_missed_handshake_is_retried_until_it_answers(fake_rebuild):
    calls, errors = fake_rebuild
    errors.extend([RuntimeError(cpu_compat.SHM_HANDSHAKE), RuntimeError(f"{cpu_compat.SHM_HANDSHAKE}\nframe #0")])
    assert reductions.rebuild_storage_filename(object, "manager", b"handle", 8) == "storage"
    assert len(calls) == 3


def test_a_handshake_that_never_answers_raises_after_the_last_try(fake_rebuild):
    calls, errors = fake_rebuild
    errors.extend(RuntimeError(cpu_compat.SHM_HANDSHAKE) for _ in range(cpu_compat.SHM_ATTEMPTS))
    with pytest.raises(RuntimeError, match="timed out"):
        reductions.rebuild_storage_filename(object, "manager", b"handle", 8)
    assert len(calls) == cpu_compat.SHM_ATTEMPTS


def test_other_errors_are_not_retried_and_the_patch_applies_once(fake_rebuild):
    calls, errors = fake_rebuild
    errors.append(RuntimeError("No such file or directory"))
    patched = reductions.rebuild_storage_filename
    cpu_compat.retry_shm_handshake()
    assert reductions.rebuild_storage_filename is patched
    with pytest.raises(RuntimeError, match="No such file"):
        reductions.rebuild_storage_filename(object, "manager", b"handle", 8)
    assert len(calls) == 1


def test_a_file_system_payload_pickled_after_the_patch_rebuilds(monkeypatch):
    """The wrapper keeps the original's name, so the pickle names a function the receiver finds."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    cpu_compat.retry_shm_handshake()
    assert reductions.rebuild_storage_filename.rollverify_retry
    saved = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        x = torch.randn(6, 5)
        payload = bytes(ForkingPickler.dumps(x))
        assert b"rebuild_storage_filename" in payload
        assert torch.equal(pickle.loads(payload), x)
    finally:
        tmp.set_sharing_strategy(saved)
