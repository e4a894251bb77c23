"""The option groups of the `zeroserve` commands, each a list of options that
`option_group` applies as one decorator: what a model is (MODEL_OPTION, MODELS_OPTIONS),
logging, the engine (ENGINE_OPTIONS, EngineConfig's flags), the gateway (GATEWAY_OPTIONS,
with the HTTP access flags), the worker plane's addresses, and a worker's process, model
and resilience flags. A command takes the groups it needs; configs.py turns what they give
into the frozen configs.
"""

from __future__ import annotations

import click

from zeroserve.cli.params import (
    ByteSize,
    ListItem,
    check_device,
    field_default,
    list_values,
    option,
    option_group,
    positive,
    speculative_config,
)
from zeroserve.worker.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    BatchingMode,
    EngineConfig,
)
from zeroserve.worker.speculative import SpeculativeConfig

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
DTYPES = ("auto", "float32", "bfloat16", "float16")

MODEL_HELP = ('"default" (the embedded SmolLM2-135M-Instruct), a .gguf file, a Hugging Face '
              'model directory, or a Hub id ("org/name", "org/name/file.gguf"), downloaded '
              "into the Hugging Face cache once (HF_HUB_OFFLINE=1: from the cache only).")
REVISION_OPTION = option("--revision", default=None,
                         help="The Hub model's branch, tag or commit. [default: main]")
MODEL_OPTION = option_group([option("--model", default="default", help=MODEL_HELP),
                             REVISION_OPTION])

LOG_OPTIONS = [
    option("--log-format", type=click.Choice(LOG_FORMATS), default="text",
           help="text for terminals, json for one object a line."),
    option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info"),
]

ENGINE_OPTIONS = [
    option("--device", default="auto", callback=check_device,
           help="auto, cpu, cuda or cuda:N."),
    option("--dtype", type=click.Choice(DTYPES), default="auto"),
    option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto",
           help="The KV cache's dtype: bfloat16 stores K/V in half the bytes of float32 "
                "under float32 activations (attention widens them back to float32 exactly "
                "as it reads them; the CPU only). [default: auto, the activations' dtype]"),
    option("--max-num-seqs", type=click.IntRange(min=1),
           default=field_default(EngineConfig, "max_num_seqs"),
           help="Most sequences in one batch."),
    option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
           help="Token budget of one step (prefill chunks + decodes). [default: "
                f"{EngineConfig.max_num_batched_tokens}, or --max-num-seqs if larger, so that "
                "every running sequence decodes at each step]"),
    option("--max-prefill-tokens-with-decodes", type=click.IntRange(min=0),
           default=field_default(EngineConfig, "max_prefill_tokens_with_decodes"),
           help="Prefill tokens a step may carry beside running decodes (or as many as "
                "there are decodes, where that is more), so that a long prompt delays no "
                "stream's next token by more than a small chunk; a step without decodes "
                "takes the whole --max-num-batched-tokens. 0: no cap."),
    option("--max-model-len", type=click.IntRange(min=1), default=None,
           help="Context length cap. [default: the model's own]"),
    option("--block-size", type=click.IntRange(min=1), default=field_default(EngineConfig, "block_size"),
           help="Tokens per KV block (a power of two)."),
    option("--num-kv-blocks", type=click.IntRange(min=1), default=None,
           help="KV pool size in blocks; wins over --kv-cache-memory."),
    option("--kv-cache-memory", type=ByteSize(), default=None,
           help="KV pool size in bytes, e.g. 4GiB. [default: from free memory]"),
    option("--enable-prefix-caching/--no-enable-prefix-caching",
           default=field_default(EngineConfig, "enable_prefix_caching")),
    option("--batching-mode", type=click.Choice([m.value for m in BatchingMode]),
           default=BatchingMode.CONTINUOUS.value,
           help="continuous is the product; static and dynamic are benchmark baselines."),
    option("--batch-wait-ms", type=click.FloatRange(min=0),
           default=field_default(EngineConfig, "batch_wait_ms"), help="dynamic mode's window."),
    option("--num-threads", type=click.IntRange(min=1), default=None,
           help="torch CPU threads. [default: torch's]"),
    option("--attention-backend", type=click.Choice(ATTENTION_BACKENDS),
           default=field_default(EngineConfig, "attention_backend"),
           help="Decode attention: native (a CPU kernel compiled on first use), torch, or "
                "auto (native for bfloat16 on the CPU where it builds)."),
    option("--backend", type=click.Choice(["model", "fake"]), default="model",
           help="fake emits tokens without a model (tests and benchmarks only)."),
    option("--seed", type=int, default=field_default(EngineConfig, "seed")),
    option("--fake-forward-ms", type=click.FloatRange(min=0), default=0.0,
           help="--backend fake only: simulated milliseconds per forward."),
    option("--speculative-config", default=SpeculativeConfig().to_json(),
           callback=speculative_config,
           help="Speculative decoding, as vLLM's JSON (n-gram prompt lookup: up to "
                "num_speculative_tokens drafts per request and step, as many as that "
                "request's acceptance so far pays for; steps with more running requests than "
                "disable_by_batch_size decode normally; where a request's own context has no "
                "match, drafts may come from the last recent_ngrams n-grams of other "
                "requests' outputs, 0 for none; keys left out take the defaults shown). "
                "'null' turns it off."),
    option("--weight-cache/--no-weight-cache", default=field_default(EngineConfig, "weight_cache"),
           help="Write the prepared weights once and memory-map them on later starts."),
    option("--weight-cache-dir", default=None,
           help="Where the weight cache lives. [default: $ZEROSERVE_CACHE_DIR/weights or "
                "~/.cache/zeroserve/weights]"),
    option("--int8-activations/--no-int8-activations",
           default=field_default(EngineConfig, "int8_activations"),
           help="Decode rows on the CPU's 4-bit/8-bit block kernels (fp32) quantize "
                "their activations to int8 per block of 32 and use integer dot products "
                "(VNNI where the CPU has it), as llama.cpp does; prompt rows stay fp32. "
                "[default: on with --dtype auto, off with an explicit --dtype: --dtype "
                "float32 alone is the exact reference path]"),
    option("--batch-invariant/--no-batch-invariant",
           default=field_default(EngineConfig, "batch_invariant"),
           help="Each request's tokens the same whatever else shares its batch, at a cost "
                "in throughput (docs/deployment/hardware.md: Batch invariance)."),
    option("--enforce-eager/--no-enforce-eager", default=None,
           help="Run the decode step eagerly, or compile it (inductor on the CPU, cached in "
                "$ZEROSERVE_CACHE_DIR/inductor; CUDA graphs on CUDA). [default: CUDA graphs "
                "on CUDA, eager on the CPU]"),
    option("--max-capture-batch-size", type=click.IntRange(min=1), default=None,
           help="Compiled decode steps up to this many sequences; larger ones run eagerly. "
                "[default: --max-num-seqs]"),
    option("--kv-offloading-size", type=click.FloatRange(min=0),
           default=field_default(EngineConfig, "kv_offloading_size"),
           help="GiB of shared memory for the box's KV tier: full KV blocks every worker of "
                "the box can load instead of computing (failover, restart, prefixes another "
                "worker computed). 0: off. Off, with a warning, where the folder's file "
                "system is smaller (a container's 64 MiB /dev/shm)."),
    option("--kv-offloading-dir", default=None,
           help="The KV tier's shared-memory folder (mode 700). "
                "[default: /dev/shm/zeroserve-$UID/kv-tier]"),
    option("--kv-tier-dir", default=None,
           help="A disk folder below the KV tier: it keeps what memory evicts, and survives "
                "a restart of the box. [default: none]"),
    option("--kv-tier-dir-size", type=click.FloatRange(min=0, min_open=True),
           default=field_default(EngineConfig, "kv_tier_dir_size"),
           help="GiB the --kv-tier-dir level may hold."),
    option("--kv-pool-in-tier/--no-kv-pool-in-tier",
           default=field_default(EngineConfig, "kv_pool_in_tier"),
           help="On the CPU, the worker's KV pool is a file in the tier's folder and full "
                "blocks are published without a copy, where the live pools take at most half "
                "of --kv-offloading-size; off: blocks are copied into the tier."),
    option("--kv-transfer-config", default=None,
           help="vLLM's JSON for an offloading KV connector, read onto the flags above: "
                '{"kv_connector": "OffloadingConnector" or "LMCacheConnectorV1", "kv_role": '
                '"kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": BYTES} or '
                "LMCache's local_cpu, max_local_cpu_size, local_disk, max_local_disk_size}. "
                "[default: none]"),
]

# Who may call the HTTP API, and how often (gateway/http/auth.py, gateway/http/rate_limit.py).
HTTP_ACCESS_OPTIONS = [
    option("--api-key", "api_keys", type=ListItem(), multiple=True, callback=list_values,
           help="Bearer key required on /v1/*, /tokenize and /detokenize (repeat it, or "
                "separate keys with commas). [default: none: the API is open]"),
    option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
           help="A file of API keys, one a line (blank lines and # comments skipped), added "
                "to --api-key."),
    option("--allowed-origins", type=ListItem(), multiple=True, callback=list_values,
           help="Origins whose web pages may read replies (CORS), e.g. https://app.example "
                "or '*'. [default: none: browsers cannot read replies]"),
    option("--allowed-hosts", type=ListItem(), multiple=True, callback=list_values,
           help="Host header values accepted (e.g. api.example.com, *.example.com, [fd00::2], or "
                "'*' for any); others get 421. Loopback names always pass. [default: loopback "
                "names only when --host is a loopback address (against DNS rebinding), else "
                "any]"),
    option("--rate-limit-rps", type=click.FloatRange(min=0, min_open=True), default=None,
           help="Requests per second per API key (per client IP without keys). "
                "[default: unlimited]"),
    option("--rate-limit-burst", type=click.IntRange(min=1), default=None,
           help="Requests a key may send at once. [default: --rate-limit-rps rounded up]"),
    option("--rate-limit-tpm", type=click.IntRange(min=1), default=None,
           help="Prompt + completion tokens per minute per API key (per client IP without "
                "keys), charged when a response ends. [default: unlimited]"),
    option("--rate-limits", "rate_limits_file", type=click.Path(exists=True, dir_okay=False),
           default=None,
           help="Per-key limits, a JSON or .toml file: {KEY: {requests_per_second, burst, "
                "tokens_per_minute, max_concurrent_requests, priority_class, share}}; a field "
                "left out takes the flag's default. Also a models table and the priority "
                "classes (docs/operations/rate-limits.md)."),
]

# For `serve` and `gateway`: more models beside --model, and aliases over them.
MODELS_OPTIONS = [
    option("--add-model", "extra_models", multiple=True, default=(),
           help="Serve another model beside --model: NAME[@VERSION]=PATH[:WORKERS] (repeat "
                "it; PATH as --model; `serve` starts WORKERS workers for it, default 1, with "
                "--served-model-name NAME --model-version VERSION). Clients send NAME, or "
                "NAME@VERSION for one version; versions of a NAME share its first tokenizer."),
    option("--model-alias", "model_aliases", multiple=True, default=(),
           help="A name spread over served models or versions by weight: "
                "ALIAS=TARGET:WEIGHT,... (e.g. chat=smollm@v1:90,smollm@v2:10); a request "
                "naming a conversation (user, prompt_cache_key, X-Session-ID) always gets the "
                "same target while the weights stay. `zeroserve models set-weights` changes "
                "them live."),
]

GATEWAY_OPTIONS = [
    option("--host", default="127.0.0.1", help="HTTP bind address."),
    option("--port", type=click.IntRange(0, 65535), default=8000, help="HTTP port."),
    option("--served-model-name", default=None,
           help="The model id clients use. [default: from the model file]"),
    option("--chat-template", default=None, type=click.Path(dir_okay=False),
           help="A jinja2 file (or a tokenizer_config.json) whose chat template replaces the "
                "model's own. [default: the model's]"),
    option("--reasoning-parser", type=click.Choice(["qwen3", "deepseek_r1"]), default=None,
           help="Split a reasoning model's <think> text from its answer (chat's "
                "reasoning_content, Responses' reasoning items). [default: qwen3's rules when "
                "the chat template writes <think>, else none]"),
    option("--allow-extra-tool-arguments", is_flag=True, default=False,
           help="A forced tool call (tool_choice required or named) may write argument keys "
                "its schema does not declare. [default: off: a schema that does not set "
                "additionalProperties gets false, as llama.cpp's grammars]"),
    option("--responses-dir", default=None, type=click.Path(file_okay=False),
           help="A private folder (mode 700) for stored responses (/v1/responses with store); "
                "the gateways of a tier share it. [default: beside the ipc sockets, by port]"),
    option("--response-store-size", type=click.IntRange(min=1), default=1000,
           help="Stored responses kept per API key; beyond, the oldest go."),
    option("--response-store-ttl", type=float, default=24 * 3600.0, callback=positive,
           help="Seconds a stored response is kept."),
    option("--credit-window", type=click.IntRange(min=1), default=32,
           help="Tokens of one stream in flight before the client must read."),
    option("--slow-client-timeout", type=float, default=30.0, callback=positive,
           help="Seconds a stream may make no progress before it is aborted."),
    option("--max-queued-requests", type=click.IntRange(min=0), default=256,
           help="Requests waiting for a worker; beyond: 429."),
    option("--max-waiting-per-worker", type=click.IntRange(min=0), default=None,
           help="Requests a worker may hold beyond its --max-num-seqs, in its own queue; "
                "more wait in the gateway's (fair) queue. Small values let the gateway's "
                "order decide who runs next. [default: as many as its --max-num-seqs]"),
    option("--queue-timeout", type=float, default=60.0, callback=positive,
           help="Seconds a queued request waits for a worker before a 503."),
    option("--worker-timeout", type=float, default=3.0, callback=positive,
           help="Seconds without a heartbeat before a worker counts as lost."),
    option("--min-client-rate", type=click.FloatRange(min=0), default=1024.0,
           help="Bytes/s a stream must reach over each --slow-client-timeout window while "
                "the client holds it up (its writes blocked most of the window); slower "
                "streams are aborted. 0: off."),
    option("--client-send-buffer", type=ByteSize(), default=64 * 1024,
           help="Kernel send buffer per client connection (e.g. 64KiB; 0: the kernel's "
                "autotuning, up to megabytes). It bounds what a client that stops reading "
                "is sent before its stream pauses and --slow-client-timeout runs."),
    option("--admission-hold", type=click.FloatRange(0.0, 1.0), default=0.05,
           help="Seconds the relay of running streams may wait, at a time, while a burst of "
                "requests is being admitted, so that the burst gets in first (its last "
                "request's first token comes sooner; running streams' tokens come in one "
                "later write). At most half the time; 0: off."),
    option("--loop-lag-warn", type=float, default=0.25, callback=positive,
           help="Seconds of event-loop lag that count as a stall: logged (rate-limited) and "
                "counted in /health."),
    option("--request-idle-timeout", type=float, default=300.0, callback=positive,
           help="Seconds a running request with credit may receive nothing from its worker "
                "before it fails (504) and is aborted there."),
    option("--admin-key", default=None,
           help="Bearer key for the admin API (`zeroserve workers ...`); API keys never grant "
                "it. [default: none: loopback clients only]"),
    option("--worker-stall-timeout", type=float, default=30.0, callback=positive,
           help="Seconds a worker's engine may make no progress (its heartbeats say) before it "
                "is marked unhealthy and gets no new work."),
    option("--shutdown-timeout", type=float, default=5.0, callback=positive,
           help="On SIGTERM, seconds running streams get to finish (new and queued requests "
                "get a 503 at once); then they end with an error event."),
    option("--reuse-port", is_flag=True, default=False,
           help="Bind the HTTP port with SO_REUSEPORT so that several gateway processes "
                "share it (`serve --gateways N` sets it)."),
    option("--routing", type=click.Choice(["cache_aware", "least_loaded"]),
           default="cache_aware",
           help="Which worker gets a request: cache_aware (the one holding the prompt's "
                "prefix in its KV cache, within a load bound) or least_loaded."),
    option("--scheduling-policy", type=click.Choice(["fair", "fcfs"]), default="fair",
           help="The gateway's queue: fair (priority classes from the rate limits file, "
                "fair queuing across API keys, the lowest class shed first; workers admit and "
                "preempt by class) or fcfs (one first-in, first-out queue)."),
    option("--otlp-traces-endpoint", default=None,
           help="Send a trace per request (queue, prefill and decode spans) to this OTLP "
                "collector: http://host:4318 (OTLP/HTTP) or grpc://host:4317. Needs "
                "`pip install 'zeroserve[tracing]'`. [default: no tracing]"),
    option("--metrics-dir", default=None,
           help="Gateways of one tier share this folder: each writes its metrics there and "
                "GET /metrics on any of them answers for all, each gateway's own series "
                "labelled gateway=\"INDEX\" (`serve --gateways N` sets it). [default: none]"),
    option("--gateway-index", type=click.IntRange(min=0), default=0,
           help="This gateway's index in its tier (`serve --gateways N` sets it)."),
    option("--disable-metrics", is_flag=True, default=False,
           help="No Prometheus metrics: GET /metrics answers 404 and requests record "
                "nothing."),
    option("--disable-ui", is_flag=True, default=False,
           help="No web console: GET /ui answers 404."),
    # HTTP input limits (gateway/http/request_body.py, gateway/api/limits.py, gateway/http/http_protocol.py)
    option("--max-request-body", type=ByteSize(), default=8 * 1024 * 1024,
           help="Largest request body in bytes (e.g. 8MiB); beyond: 413."),
    option("--request-body-timeout", type=float, default=30.0, callback=positive,
           help="Seconds a request body may take to arrive; beyond: 408."),
    option("--header-timeout", type=float, default=10.0, callback=positive,
           help="Seconds a request's head (request line and headers) may take to arrive; "
                "beyond: the connection is closed."),
    option("--max-tokens-limit", type=click.IntRange(min=1), default=4096,
           help="Server cap on max_tokens; a chat request without max_tokens gets the room "
                "left in the context, at most this."),
    option("--max-prompt-chars", type=click.IntRange(min=1), default=1_000_000,
           help="Characters per prompt, per conversation and per /tokenize input; beyond: 400."),
    *HTTP_ACCESS_OPTIONS,
]

ADDRESS_OPTIONS = [
    option("--router-address", type=ListItem(), multiple=True, callback=list_values,
           help="Gateway ROUTER endpoint (ipc:// or tcp://); a worker or `serve --gateways "
                "N` takes one per gateway (repeat it, or separate with commas). "
                "[default: ipc, from --port]"),
    option("--tokens-address", type=ListItem(), multiple=True, callback=list_values,
           help="Gateway PULL endpoint for tokens, one per gateway as --router-address. "
                "[default: ipc, from --port]"),
    option("--keys-dir", default=None,
           help="CurveZMQ key set (`zeroserve keys generate DIR`): required for tcp:// "
                "endpoints; only workers whose key is in it can connect, each as its own id."),
    option("--insecure", is_flag=True, default=False,
           help="Allow tcp:// endpoints without keys (only on a network you trust)."),
]

# For `worker`: gateways found by DNS (worker/discovery.py), e.g. a Kubernetes headless Service.
GATEWAY_DNS_OPTIONS = [
    option("--gateway-dns", default=None,
           help="A DNS name that resolves to every gateway (e.g. a headless Service): link to "
                "each address, re-resolved every --gateway-dns-interval, instead of "
                "--router-address/--tokens-address. The gateways share one key pair."),
    option("--gateway-router-port", type=click.IntRange(1, 65535), default=5555,
           help="With --gateway-dns: the port of every gateway's ROUTER."),
    option("--gateway-tokens-port", type=click.IntRange(1, 65535), default=5556,
           help="With --gateway-dns: the port of every gateway's tokens PULL."),
    option("--gateway-dns-interval", type=float, default=5.0, callback=positive,
           help="With --gateway-dns: seconds between lookups."),
]

# For `serve` and `worker`: how a worker rides out a silent gateway and a stuck engine.
WORKER_RESILIENCE_OPTIONS = [
    option("--gateway-grace", type=float, default=120.0, callback=positive,
           help="Seconds a worker keeps its streams (paused at their credit) while the gateway "
                "is silent, e.g. stalled or restarting; then it fails them and frees their KV."),
    option("--stall-timeout", type=float, default=120.0, callback=positive,
           help="Seconds without engine progress after which a worker exits (code 4) so that "
                "its supervisor or container runtime restarts it."),
    option("--max-step-failures", type=click.IntRange(min=1), default=3,
           help="Engine steps failing in a row before a worker exits (code 1); a single "
                "failure fails only the streams of that step."),
]

# For `worker`: what its HELLO announces (the gateway routes by it).
WORKER_MODEL_OPTIONS = [
    option("--served-model-name", default="",
           help="The name clients use for this worker's model; it must be one the gateway "
                "serves (--model's, or an --add-model NAME). [default: the gateway's default "
                "model]"),
    option("--model-version", default="v1",
           help="This worker's version label for its model (e.g. v2 for a canary); "
                "requests can name it as NAME@VERSION and aliases weigh versions."),
]

WORKER_PROCESS_OPTIONS = [
    option("--heartbeat-interval", type=float, default=0.5, callback=positive,
           help="Seconds between heartbeats to the gateway."),
    option("--gateway-timeout", type=float, default=5.0, callback=positive,
           help="Seconds of gateway silence before failing in-flight work and saying HELLO "
                "again."),
    option("--drain-timeout", type=click.FloatRange(min=0), default=30.0,
           help="On SIGTERM, seconds to finish in-flight requests before failing them."),
]
