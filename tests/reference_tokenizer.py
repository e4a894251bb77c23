"""transformers' tokenizer of the default model (read from its GGUF file): the reference no one
here wrote, for the gateway's tokenizer and chat-template tests and the worker's tests that hold
the engine to transformers. Loaded once a session for both (10-30 s on two cores); callers only
read it."""

from __future__ import annotations

import functools


@functools.cache
def default_reference_tokenizer():
    from transformers import AutoTokenizer

    from zeroserve.common.model_files import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
