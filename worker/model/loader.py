"""Loading a model once per worker process: GGUF file or Hugging Face directory -> LlamaModel.

read the file (worker.model.gguf_weights / hf_weights) -> prepare (worker.model.prepare) ->
LlamaModel. With a weight cache the first two steps run once; later starts map their result.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from zeroserve.common.model_files import model_display_name, resolve_model
from zeroserve.worker.device import dtype_name
from zeroserve.worker.model.info import ModelInfo
from zeroserve.worker.model.llama import LlamaModel
from zeroserve.worker.model.llama_config import UnsupportedModelError
from zeroserve.worker.model.prepare import packing, prepare_weights
from zeroserve.worker.model.weights import ModelWeights, PreparedWeights
from zeroserve.worker.startup import StartupTimer
from zeroserve.worker.weight_cache import WeightCache

logger = logging.getLogger(__name__)


def load_weights(path: Path) -> ModelWeights:
    """Read a .gguf file or a HF directory (config.json + *.safetensors) into HF-named weights."""
    # Imported here: a start that maps the weight cache never needs gguf or safetensors.
    if path.is_dir():
        from zeroserve.worker.model.hf_weights import load_hf_directory

        return load_hf_directory(path)
    if path.suffix == ".gguf":
        from zeroserve.worker.model.gguf_weights import load_gguf

        return load_gguf(path)
    raise UnsupportedModelError(f"{path} is neither a .gguf file nor a Hugging Face directory")


def _read_and_prepare(path: Path, dtype: torch.dtype, pack: str,
                      timer: StartupTimer) -> PreparedWeights:
    with timer.phase("load_weights"):
        weights = load_weights(path)
    timer.notes["file_tensor_types"] = ", ".join(
        f"{name} x{count}" for name, count in sorted(weights.tensor_types.items()))
    with timer.phase("quantize"):
        return prepare_weights(weights, dtype, pack)


def prepared_weights(path: Path, device: torch.device, dtype: torch.dtype,
                     cache: WeightCache | None = None,
                     timer: StartupTimer | None = None,
                     prompt_dtype: torch.dtype | None = None,
                     int8_activations: bool = False) -> PreparedWeights:
    """The model's prepared tensors: mapped from the cache, or read, prepared and cached."""
    timer = timer or StartupTimer()
    pack = packing(device, dtype, prompt_dtype, int8_activations)
    if cache is None:
        timer.notes["weight_cache"] = "off"
        return _read_and_prepare(path, dtype, pack, timer)
    with timer.phase("load_weights"):
        entry = cache.entry(path, dtype, device, pack)
        prepared = entry.load()
    if prepared is None:
        waited_from = time.perf_counter()
        with entry.lock():
            timer.add("cache_wait", time.perf_counter() - waited_from)
            prepared = entry.load()  # another worker may have built it while we waited
            if prepared is None:
                prepared = _read_and_prepare(path, dtype, pack, timer)
                with timer.phase("cache_write"):
                    entry.store(prepared)
                timer.notes["weight_cache"] = f"miss (written to {entry.path})"
                return prepared
    timer.notes.setdefault("weight_cache", f"hit ({entry.path})")
    return prepared


def load_model(model: str, device: torch.device, dtype: torch.dtype,
               max_model_len: int | None = None, cache: WeightCache | None = None,
               timer: StartupTimer | None = None,
               batch_invariant: bool = False,
               prompt_dtype: torch.dtype | None = None,
               int8_activations: bool = False) -> tuple[LlamaModel, ModelInfo]:
    """`model` as EngineConfig.model ("default", a .gguf path or a HF directory).

    The context in effect is the smaller of max_model_len and the model's own. `prompt_dtype`:
    bf16 for the projections' dense copies beside fp32 (worker.device.resolve_precision).
    `int8_activations`: every row of the layers' projections will take int8 activations
    (LlamaModel.use_int8_activations, which the caller then calls), so the projections with
    a block copy need no dense copy and get none (prepare.INT8_ROWS).
    """
    timer = timer or StartupTimer()
    path = resolve_model(model)
    prepared = prepared_weights(path, device, dtype, cache, timer, prompt_dtype,
                                int8_activations)
    config = prepared.config
    timer.notes["weights_memory"] = prepared.memory_summary()
    logger.info("%s: %s model, %s weights in %s (file: %s)", path.name, config.architecture,
                dtype_name(dtype), timer.notes["weights_memory"],
                timer.notes.get("file_tensor_types", "prepared, from the weight cache"))
    context_len = config.max_position_embeddings
    if max_model_len is not None:
        context_len = min(context_len, max_model_len)
    info = ModelInfo(
        name=model_display_name(model),
        path=str(path),
        max_model_len=context_len,
        vocab_size=config.vocab_size,
        eos_token_ids=prepared.eos_token_ids,
        bos_token_id=prepared.bos_token_id,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        device=str(device),
        dtype=dtype_name(dtype) + (f" (prompt projections {dtype_name(prompt_dtype)})"
                                   if prompt_dtype not in (None, dtype) else ""),
    )
    with timer.phase("model"):
        return LlamaModel(prepared, context_len, device, dtype, batch_invariant), info
