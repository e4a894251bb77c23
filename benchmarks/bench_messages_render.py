"""What the Messages API's stream costs per token in the gateway: one update rendered as
Anthropic's events (MessageBuilder.push + sse_events) against one OpenAI chat chunk
(chat_chunk), in-process, for a stream of N one-token updates.

    python benchmarks/bench_messages_render.py --tokens 200000
"""

from __future__ import annotations

import argparse
import time

from zeroserve.gateway.api.anthropic_events import MessageBuilder, sse_events
from zeroserve.gateway.api.responses import ResponseContext, chat_chunk
from zeroserve.gateway.generation import ChoiceUpdate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    args = parser.parse_args()
    updates = [ChoiceUpdate(0, "tok", [1], None, None) for _ in range(args.tokens)]
    ctx = ResponseContext("chat", "model")
    started = time.perf_counter()
    for update in updates:
        chat_chunk(ctx, update, None)
    chat_s = time.perf_counter() - started
    builder = MessageBuilder()
    started = time.perf_counter()
    for update in updates:
        sse_events(builder.push("", update.text))
    messages_s = time.perf_counter() - started
    print(f"chat chunk: {chat_s / args.tokens * 1e6:.2f} us/token; "
          f"messages events: {messages_s / args.tokens * 1e6:.2f} us/token "
          f"({args.tokens} tokens)")


if __name__ == "__main__":
    main()
