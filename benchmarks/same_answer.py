"""Is the same request answered the same? Against a running server: 8 chat prompts at
temperature 0, each sent twice one after the other (the second finds its prompt in the prefix
cache), then all 8 at once, then 4 of them streamed against not streamed; prints how many
came back identical and exits 1 unless all did.

    .venv/bin/python benchmarks/same_answer.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys

import httpx

PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the "
           "members agreed to fund the new library, repair the bridge on Mill Street, and "
           "hire two more teachers.")
CHATS = ["Hi!", "What is the capital of France?", "Write a haiku about caches.",
         f"Summarize: {PASSAGE}", f"Rewrite in the past tense: {PASSAGE} {PASSAGE}",
         "Explain TCP in two sentences.", f"List three facts from this text: {PASSAGE}",
         "Tell me a story about a dragon and a mouse who become friends."]


def ask(url: str, model: str, question: str, max_tokens: int, stream: bool = False) -> str:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": question}]}
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    def one(question: str, stream: bool = False) -> str:
        return ask(args.url, args.model, question, args.max_tokens, stream)

    first = [one(q) for q in CHATS]
    second = [one(q) for q in CHATS]
    with concurrent.futures.ThreadPoolExecutor(len(CHATS)) as pool:
        together = list(pool.map(one, CHATS))
    streamed = [one(q, stream=True) for q in CHATS[:4]]
    results = {"sent twice": (sum(a == b for a, b in zip(first, second, strict=True)), 8),
               "all at once": (sum(a == b for a, b in zip(first, together, strict=True)), 8),
               "streamed": (sum(a == b for a, b in zip(first, streamed, strict=False)), 4)}
    for name, (same, total) in results.items():
        print(f"{name}: {same} of {total} identical")
    return 0 if all(same == total for same, total in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
