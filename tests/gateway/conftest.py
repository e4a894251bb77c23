"""Fixtures shared by the gateway tests."""

from __future__ import annotations

import gc

import pytest

from tests.reference_tokenizer import default_reference_tokenizer


@pytest.fixture(scope="session")
def reference():
    """transformers' tokenizer from the same GGUF file: the reference no one here wrote (the
    same object tests/worker's reference tests use: loaded once a session; tests only read
    it)."""
    pytest.importorskip("transformers")
    return default_reference_tokenizer()


@pytest.fixture
def collector_off():
    """The garbage collector off for the test (its objects counted by gc.collect())."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()
