"""Tiny random Llama models written to disk (HF directory and GGUF), and a hand-driven
generation loop for the model runner that stands in for the scheduler.

The GGUF writer here re-implements llama.cpp's Q/K permutation independently of the loader's
inverse, so a loader bug in either direction shows up as a logits mismatch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.reference_tokenizer import default_reference_tokenizer  # noqa: F401 (re-exported)
from tests.session_cache import session_cache_dir
from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput
from zeroserve.worker.sequence import SamplingParams

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
    rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
)


def make_tiny_hf_model(seed: int = 0, **overrides):
    """A random LlamaForCausalLM with peaked logits (std 0.2), so greedy ties are unlikely."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {**TINY, "tie_word_embeddings": True, "initializer_range": 0.2, **overrides}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).float().eval()
    with torch.no_grad():  # norms start at 1.0; jitter them so a wrong norm weight shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hf_dir(model, directory: Path, generation_eos: list[int] | None = None) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": generation_eos})
        )
    return directory


def permute_qk_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)  # kind: weight or bias
    return f"blk.{index}.{_GGUF_NAMES[module]}.{kind}"


def add_gguf_hparams(writer: gguf.GGUFWriter, cfg) -> None:
    """The shape and rope keys llama.cpp's converter writes for a transformers config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def encode_prompts(tokenizer, texts: list[str], chats: list[str]) -> list[list[int]]:
    """Plain texts as they are, then each chat question through the chat template."""
    ids = [tokenizer(t)["input_ids"] for t in texts]
    for question in chats:
        ids.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        ))
    return ids


def write_gguf(model, path: Path, qtype=gguf.GGMLQuantizationType.F32) -> Path:
    """The HF model's weights as llama.cpp's converter would write them; 2-D tensors in qtype."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    add_gguf_hparams(writer, cfg)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = permute_qk_like_llama_cpp(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = permute_qk_like_llama_cpp(array, cfg.num_key_value_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session", autouse=True)
def _weight_cache_in_tmp(tmp_path_factory):
    """Runners built here cache their models' weights in the session's cache folder, not in
    the user's ~/.cache/zeroserve: the one tests/e2e's real-model server filled earlier in the
    run, so the default model's float32 weights are found prepared."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZEROSERVE_CACHE_DIR", str(session_cache_dir(tmp_path_factory)))
        yield


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama over a byte-level vocabulary (256 bytes + 2 ChatML markers)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    save_hf_dir(make_tiny_hf_model(seed, vocab_size=258, bos_token_id=256, eos_token_id=257),
                folder)
    alphabet = ByteLevel.alphabet()
    spell = sorted(alphabet, key=lambda c: ord(c))  # any 256 distinct symbols will do
    tk = Tokenizer(models.BPE({spell[b]: b for b in range(256)}, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("<|im_start|>", special=True),
                           AddedToken("<|im_end|>", special=True)])
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return folder


@pytest.fixture(scope="session")
def hf_reference_model():
    """transformers' float32 model of the default GGUF: the correctness reference. Loaded once
    for the session (dequantizing the GGUF takes 20-60 s on two cores); callers only read it."""
    from transformers import AutoModelForCausalLM

    from zeroserve.common.model_files import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_hf_model():
    return make_tiny_hf_model()


@pytest.fixture(scope="session")
def tiny_hf_dir(tiny_hf_model, tmp_path_factory) -> Path:
    return save_hf_dir(tiny_hf_model, tmp_path_factory.mktemp("tiny_hf"), generation_eos=[2, 3])


# ---- a hand-driven generation loop: the runner without the engine ----


@dataclass
class _HandSeq:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class HandLoop:
    """Greedy/sampled generation through runner.execute with a toy allocator.

    Blocks come from a shuffled free list so tables are not contiguous; `chunk_size` splits
    prefills; `preempt` maps a step number to request ids to drop (blocks freed) and
    recompute from scratch, as the scheduler's recompute preemption does.
    """

    def __init__(self, runner, seed: int = 0):
        self.runner = runner
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)

    def _grow(self, seq: _HandSeq, num_tokens: int) -> None:
        while len(seq.table) * self.runner.block_size < num_tokens:
            seq.table.append(self.free.pop())

    def _release(self, seq: _HandSeq) -> None:
        self.free.extend(seq.table)
        seq.table = []
        seq.num_computed = 0

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: SamplingParams | None = None, chunk_size: int | None = None,
                 preempt: dict[int, list[str]] | None = None) -> list[list[int]]:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        seqs = [_HandSeq(str(i), list(p), params) for i, p in enumerate(prompts)]
        step = 0
        while any(len(s.outputs) < max_tokens for s in seqs):
            for request_id in (preempt or {}).get(step, []):
                self._release(seqs[int(request_id)])
            plan = self._plan([s for s in seqs if len(s.outputs) < max_tokens], chunk_size)
            for token in self.runner.execute(plan):
                seqs[int(token.request_id)].outputs.append(token.token_id)
            step += 1
        return [s.outputs for s in seqs]

    def _plan(self, seqs: list[_HandSeq], chunk_size: int | None) -> SchedulerOutput:
        chunks = []
        for seq in seqs:
            tokens = seq.tokens
            end = len(tokens) if chunk_size is None else min(len(tokens), seq.num_computed + chunk_size)
            self._grow(seq, end)
            chunks.append(ScheduledChunk(
                request_id=seq.request_id, token_ids=tokens[seq.num_computed:end],
                start_pos=seq.num_computed, block_table=list(seq.table),
                do_sample=end == len(tokens), params=seq.params,
                prompt_token_ids=list(seq.prompt), output_token_ids=list(seq.outputs),
            ))
            seq.num_computed = end
        # The scheduler's order: decodes first, then prefill chunks.
        chunks.sort(key=lambda c: len(c.token_ids) != 1)
        return SchedulerOutput(chunks)


@pytest.fixture
def hand_loop():
    return HandLoop
