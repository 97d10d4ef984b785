"""Shared fixtures: one cached copy of each tiny model (`rollverify.app.tiny_model.cache_root()`: $ROLLVERIFY_CACHE,
else the user's cache folder) for every test session and the demo; it is made once, on first use."""

from __future__ import annotations

import pytest

from rollverify.app.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_dense_path():
    return ensure_tiny_model(TinyModelSpec())


@pytest.fixture(scope="session")
def tiny_moe_path():
    return ensure_tiny_model(TinyModelSpec(moe=True))
