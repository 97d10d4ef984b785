"""Shared fixtures: one cached copy of each tiny model for the whole test session (and the demo)."""

from __future__ import annotations

import pytest

from rollverify.tiny_model import TinyModelSpec, ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_dense_path():
    return ensure_tiny_model(TinyModelSpec())


@pytest.fixture(scope="session")
def tiny_moe_path():
    return ensure_tiny_model(TinyModelSpec(moe=True))
