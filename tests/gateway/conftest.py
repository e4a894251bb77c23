"""Fixtures shared by the gateway tests."""

from __future__ import annotations

import pytest

from zeroserve.common.model_files import default_model_path


@pytest.fixture(scope="session")
def reference():
    """transformers' tokenizer from the same GGUF file: the reference no one here wrote (one
    for the session: loading it takes ~10 s; tests only read it)."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
