"""The plain-PyTorch baseline: a minimal OpenAI-compatible server around transformers generate.

What a user gets by wrapping `model.generate` in a web server with static batching: requests
that arrive within `--batch-window-ms` of the first waiting one are left-padded into one
batch (up to `--max-batch-size`), generated together until every row is done, and only then
is the next batch formed. Tokens stream out as the batch produces them.

`ignore_eos` is honoured by never stopping on EOS inside generate: each row ends at its own
max_tokens, or (without ignore_eos) at its first EOS; the batch ends when every row has.
Sampling parameters of a batch are the first request's (temperature 0 -> greedy).

    python benchmarks/hf_server.py --port 8100 --dtype float32 --max-batch-size 64

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream and non-stream, with
stream_options.include_usage), GET /v1/models, GET /health.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from zeroserve.common.model_files import model_display_name, resolve_model  # noqa: E402

_DONE = object()


@dataclass
class Job:
    """One request in flight: its prompt, limits and the queue its tokens go to."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue  # token ids, then _DONE (or an Exception)
    num_generated: int = 0
    is_finished: bool = False
    finish_reason: str | None = None
    arrived_s: float = field(default_factory=time.perf_counter)

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class BatchStreamer(BaseStreamer):
    """Receives each step's [batch] new tokens from generate and routes them to their jobs."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]):
        self.jobs, self.eos_ids = jobs, eos_ids
        self.is_prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self.is_prompt:  # generate first hands over the prompt ids
            self.is_prompt = False
            return
        for job, tok in zip(self.jobs, value.reshape(-1).tolist(), strict=True):
            if job.is_finished:
                continue
            job.num_generated += 1
            if tok in self.eos_ids and not job.ignore_eos:
                job.is_finished, job.finish_reason = True, "stop"
                job.emit(_DONE)
                continue
            job.emit(tok)
            if job.num_generated >= job.max_tokens:
                job.is_finished, job.finish_reason = True, "length"
                job.emit(_DONE)

    def end(self) -> None:
        for job in self.jobs:
            if not job.is_finished:
                job.is_finished, job.finish_reason = True, "length"
                job.emit(_DONE)


class AllFinished(StoppingCriteria):
    """Stop rows whose job ended, so the batch ends with its last live row."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.tensor([j.is_finished for j in self.jobs], dtype=torch.bool)


class Batcher:
    """A thread that forms static batches from a queue and runs generate on each."""

    def __init__(self, model, tokenizer, max_batch_size: int, batch_window_s: float):
        self.model, self.tok = model, tokenizer
        self.max_batch_size, self.batch_window_s = max_batch_size, batch_window_s
        self.jobs: queue.Queue[Job] = queue.Queue()
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = {*eos, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.num_batches = 0
        threading.Thread(target=self._loop, daemon=True, name="batcher").start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def _gather(self) -> list[Job]:
        batch = [self.jobs.get()]
        deadline = time.perf_counter() + self.batch_window_s
        while len(batch) < self.max_batch_size:
            left = deadline - time.perf_counter()
            try:
                batch.append(self.jobs.get(timeout=max(left, 0)) if left > 0 else self.jobs.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._gather()
            try:
                self._generate(batch)
            except Exception as exc:  # a failed batch fails its requests, not the server
                for job in batch:
                    if not job.is_finished:
                        job.is_finished = True
                        job.emit(exc)

    @torch.inference_mode()
    def _generate(self, batch: list[Job]) -> None:
        self.num_batches += 1
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [batch, width]
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):  # left padding: generation continues at the right
            ids[row, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids):] = 1
        first = batch[0]
        sampling = (dict(do_sample=True, temperature=first.temperature, top_p=first.top_p)
                    if first.temperature > 0 else dict(do_sample=False))
        self.model.generate(
            input_ids=ids, attention_mask=mask,
            max_new_tokens=max(j.max_tokens for j in batch),
            # EOS handling is per row in BatchStreamer/AllFinished, so ignore_eos rows
            # keep generating past an EOS while their neighbours stop.
            eos_token_id=None, pad_token_id=self.pad_id,
            streamer=BatchStreamer(batch, self.eos_ids),
            stopping_criteria=[AllFinished(batch)],
            top_k=None, **sampling,
        )


def make_app(batcher: Batcher, tokenizer, model_name: str, max_model_len: int) -> Starlette:
    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "owned_by": "hf_server"}]})

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                       "code": status}}, status_code=status)

    async def completions(request: Request, is_chat: bool):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error("body is not JSON")
        if is_chat:
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                return error("messages must be a non-empty list")
            try:
                messages = [_plain_message(m) for m in body["messages"]]
                prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False)
            except (TypeError, KeyError, ValueError) as exc:
                return error(f"bad messages: {exc}")
        else:
            if not isinstance(body.get("prompt"), str):
                return error("prompt must be a string")
            prompt_ids = tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        prompt_ids = list(prompt_ids)
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if max_tokens < 1 or len(prompt_ids) + max_tokens > max_model_len:
            return error(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds {max_model_len}")
        job = Job(prompt_ids, max_tokens, bool(body.get("ignore_eos", False)),
                  float(body.get("temperature", 1.0) or 0.0), float(body.get("top_p", 1.0)),
                  asyncio.get_running_loop(), asyncio.Queue())
        batcher.submit(job)
        rid = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex[:16]
        obj = "chat.completion" if is_chat else "text_completion"
        created = int(time.time())
        usage_of = lambda: {"prompt_tokens": len(prompt_ids), "completion_tokens": job.num_generated,  # noqa: E731
                            "total_tokens": len(prompt_ids) + job.num_generated}

        if not body.get("stream"):
            ids = [t async for t in _tokens(job)]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if is_chat
                      else {"index": 0, "text": text})
            choice["finish_reason"] = job.finish_reason
            return JSONResponse({"id": rid, "object": obj, "created": created,
                                 "model": model_name, "choices": [choice], "usage": usage_of()})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if is_chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return "data: " + json.dumps({"id": rid, "object": obj + ".chunk", "created": created,
                                          "model": model_name, "choices": [choice]}) + "\n\n"

        async def events():
            ids: list[int] = []
            sent = ""
            try:
                async for tok in _tokens(job):
                    if is_chat and not ids:
                        # The role chunk goes with the first token, not before prefill:
                        # clients such as vLLM's bench take any first chunk as the TTFT.
                        yield chunk(None, None, role=True)
                    ids.append(tok)
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    if text.endswith("\ufffd"):
                        continue  # half a UTF-8 character: wait for the rest
                    yield chunk(text[len(sent):], None)
                    sent = text
            except Exception as exc:
                yield "data: " + json.dumps({"error": {"message": str(exc)}}) + "\n\n"
                return
            yield chunk(None, job.finish_reason)
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj + ".chunk", "created": created,
                                              "model": model_name, "choices": [],
                                              "usage": usage_of()}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(request: Request):
        return await completions(request, is_chat=True)

    async def plain(request: Request):
        return await completions(request, is_chat=False)

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", plain, methods=["POST"]),
    ])


def _plain_message(message: dict) -> dict:
    """OpenAI allows content as a list of parts ({"type": "text", "text": ...}); the chat
    template wants one string."""
    content = message["content"]
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
    if not isinstance(content, str):
        raise TypeError("content must be a string or a list of text parts")
    return {"role": message["role"], "content": content}


async def _tokens(job: Job):
    while True:
        item = await job.out.get()
        if item is _DONE:
            return
        if isinstance(item, Exception):
            raise item
        yield item


def load(model: str, dtype: torch.dtype):
    path = resolve_model(model)
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        mdl = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
        mdl = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return tok, mdl.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default', a .gguf file or an HF directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--batch-window-ms", type=float, default=50.0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--max-model-len", type=int, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok, mdl = load(a.model, getattr(torch, a.dtype))
    max_len = a.max_model_len or int(getattr(mdl.config, "max_position_embeddings", 2048))
    batcher = Batcher(mdl, tok, a.max_batch_size, a.batch_window_ms / 1000)
    app = make_app(batcher, tok, model_display_name(a.model), max_len)
    print(f"hf_server: {model_display_name(a.model)} {a.dtype} on http://{a.host}:{a.port}", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
