"""The web console at /ui in a real browser: Playwright driving Debian's Chromium against
`zeroserve serve` (fake backend, two workers), as a person would use it.

Chat: a reply streams in and shows its stats, stop, regenerate, edit, export, kept across a
reload; a JSON-schema reply parses (the real model: the fake backend has no vocabulary to
constrain). Operations: both workers listed, drain and undrain from the page, a worker killed
with SIGKILL shows as restarting and comes back while a chat reply keeps streaming; the 401
path with API keys on; a gateway briefly out of reach is said so, then reconnected.
The chat and operations screenshots are saved on every run (under .bench/screenshots/, which
git ignores); with ZEROSERVE_UPDATE_SCREENSHOTS=1 they replace the docs' (docs/ui/).

Chromium: `apt-get install chromium` (scripts/setup does it as root); without it, or without
the playwright package, these tests skip and say why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from zeroserve.cli.harness import REPO_ROOT

pytestmark = pytest.mark.slow

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="the console's browser tests need the playwright package "
                                   "(pip install playwright; scripts/setup installs the test extra)")

CHROMIUM = os.environ.get("ZEROSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"the console's browser tests need Chromium at {CHROMIUM} (apt-get install "
                "chromium; scripts/setup does it as root); Playwright's own browser download "
                "is not used", allow_module_level=True)

SCREENSHOTS = REPO_ROOT / ("docs/ui" if os.environ.get("ZEROSERVE_UPDATE_SCREENSHOTS") == "1"
                            else ".bench/screenshots")
ADMIN_KEY = "console-admin-secret"
API_KEY = "sk-console-api-key"
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def server(module_servers):
    """Two fake workers at 20 ms a step (60 tokens: about 1.2 s); an admin key set."""
    return module_servers(args=("--backend", "fake", "--device", "cpu", "--workers", "2",
                                "--fake-forward-ms", "20", "--admin-key", ADMIN_KEY),
                          num_workers=2)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield chromium
        chromium.close()


class Console:
    """One browser tab on the console; page errors fail the test."""

    def __init__(self, browser, url: str, view: str = "chat"):
        self.context = browser.new_context(viewport={"width": 1360, "height": 820},
                                           accept_downloads=True)
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(f"{url}/ui#{view}")

    def tab(self, view: str) -> None:
        self.page.click(f"#tab-{view}")

    def set_keys(self, api: str = "", admin: str = "") -> None:
        self.page.click("#open-keys")
        self.page.fill("#api-key", api)
        self.page.fill("#admin-key", admin)
        self.page.click("#keys-save")

    def settings(self, max_tokens: int | None = None, schema: str | None = None) -> None:
        if max_tokens is not None:
            self.page.fill("#max-tokens", str(max_tokens))
        if schema is not None:
            self.page.fill("#json-schema", schema)

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.click("#send")

    def last_reply(self):
        return self.page.locator(".msg.assistant").last

    def wait_streaming(self) -> None:
        """Until the reply is visibly arriving: text in its bubble while it still streams."""
        self.page.wait_for_function(
            "() => (document.querySelector('.msg.assistant.streaming .bubble')"
            "?.textContent.length || 0) > 0")

    def wait_reply_done(self, timeout_ms: float = WAIT_MS) -> dict[str, str]:
        """Until the last reply has its stats; returns them by name (ttft, speed, ...)."""
        reply = self.last_reply()
        reply.locator("[data-stat=finish]").wait_for(timeout=timeout_ms)
        stats = {}
        for item in reply.locator("[data-stat]").all():
            stats[item.get_attribute("data-stat")] = item.inner_text()
        return stats

    def row(self, worker_id: str):
        return self.page.locator(f"#workers tr[data-worker='{worker_id}']")

    def status(self, worker_id: str) -> str:
        return self.row(worker_id).locator("[data-status]").get_attribute("data-status")

    def wait_status(self, worker_id: str, status: str) -> None:
        self.page.wait_for_function(
            "([id, s]) => document.querySelector(`#workers tr[data-worker='${id}'] "
            "[data-status]`)?.dataset.status === s", arg=[worker_id, status])

    def confirm_action(self, worker_id: str, action: str) -> None:
        self.row(worker_id).locator(f"button[data-action={action}]").click()
        self.page.locator("#confirm[open]").wait_for()
        self.page.click("#confirm-ok")

    def screenshot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / name))

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors


@pytest.fixture
def console(browser, server):
    opened = []

    def open_console(view: str = "chat", url: str | None = None) -> Console:
        opened.append(Console(browser, url or server.url, view))
        return opened[-1]

    yield open_console
    for c in opened:
        c.close()


# --- chat ----------------------------------------------------------------------------------

def test_a_chat_reply_streams_in_with_its_stats(console):
    c = console()
    c.page.locator("#model option").first.wait_for(state="attached")
    assert c.page.input_value("#model") == "SmolLM2-135M-Instruct"
    c.settings(max_tokens=60)
    c.page.fill("#system-prompt", "You are a concise assistant.")
    c.send("Write a haiku about caches.")
    c.wait_streaming()
    stats = c.wait_reply_done()
    assert re.fullmatch(r"TTFT \d+ ms", stats["ttft"]), stats
    assert re.fullmatch(r"speed [\d.]+ tok/s", stats["speed"]), stats
    assert stats["completion"] == "tokens 60" and stats["finish"] == "finish length"
    assert re.fullmatch(r"prompt \d+", stats["prompt"]) and stats["cached"].startswith("cached ")
    first = c.last_reply().locator(".bubble").inner_text()
    assert len(first) > 20

    # Regenerate: the reply is replaced (the fake backend is deterministic for a seed, so
    # only the count of replies is compared), and its stats are new.
    c.last_reply().get_by_role("button", name="Regenerate").click()
    c.wait_reply_done()
    assert c.page.locator(".msg.assistant").count() == 1

    # Edit the question: the turn after it is dropped and asked again.
    c.page.locator(".msg.user").get_by_role("button", name="Edit").click()
    c.page.locator(".msg.user .edit-box textarea").fill("Write a haiku about paged KV caches.")
    c.page.get_by_role("button", name="Save and send").click()
    c.wait_reply_done()
    assert c.page.locator(".msg.user .bubble").inner_text() == "Write a haiku about paged KV caches."
    assert c.page.locator(".msg").count() == 2

    # Stop: a long reply ends where it was stopped, marked so.
    c.settings(max_tokens=3000)
    c.send("Tell me a long story.")
    c.wait_streaming()
    c.page.click("#stop")
    stats = c.wait_reply_done()
    assert stats["finish"] == "finish stopped"
    assert c.page.is_visible("#send") and not c.page.is_visible("#stop")

    # Kept in the browser and exportable as JSON.
    c.page.reload()
    assert c.page.locator(".msg").count() == 4
    with c.page.expect_download() as download:
        c.page.click("#export-chats")
    exported = json.loads(Path(download.value.path()).read_text())
    messages = exported["conversations"][0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["stats"]["completionTokens"] == 60
    # Delete asks first; cancelled, the chat stays.
    c.page.click("#delete-chat")
    c.page.click("#confirm-cancel")
    assert c.page.locator("#conversations li").count() == 1
    c.page.click("#new-chat")
    c.settings(max_tokens=90)
    c.send("What does a paged KV cache save?")
    c.wait_reply_done()
    c.screenshot("chat.png")


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_reasoning_and_refusals_are_shown_as_such(console):
    """What the fake backend never sends, played by the browser's network layer: a reasoning
    model's deltas, and the refusals a busy or keyed server gives."""
    c = console()
    c.settings(max_tokens=50)
    answers = [
        dict(status=200, content_type="text/event-stream", body=sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "The user "}}]},
            {"choices": [{"index": 0, "delta": {"reasoning_content": "wants a number."}}]},
            {"choices": [{"index": 0, "delta": {"content": "Forty-two."}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9,
                                      "prompt_tokens_details": {"cached_tokens": 8}}})),
        dict(status=429, headers={"Retry-After": "7"}, content_type="application/json",
             body=json.dumps({"error": {"message": "Too many requests are waiting.",
                                        "type": "rate_limit_error", "code": "queue_full"}})),
        dict(status=503, headers={"Retry-After": "3"}, content_type="application/json",
             body=json.dumps({"error": {"message": "No worker took the request in time.",
                                        "type": "server_error", "code": "queue_timeout"}})),
        dict(status=200, content_type="text/event-stream", body=sse(
            {"choices": [{"index": 0, "delta": {"content": "Half"}}]},
            {"error": {"message": "The stream was aborted.", "type": "server_error"}})),
        dict(status=200, content_type="text/event-stream",  # cut: no finish, no [DONE]
             body='data: {"choices": [{"index": 0, "delta": {"content": "Cut"}}]}\n\n'),
    ]
    c.page.route("**/v1/chat/completions", lambda route: route.fulfill(**answers.pop(0)))

    c.send("Think, then answer.")
    stats = c.wait_reply_done()
    reply = c.last_reply()
    assert reply.locator(".reasoning").inner_text() == "Reasoning\nThe user wants a number."
    assert reply.locator(".bubble").inner_text() == "Forty-two."
    assert (stats["prompt"], stats["cached"]) == ("prompt 12", "cached 8")

    error = c.page.locator("#chat-error")
    c.send("Again?")
    error.filter(has_text="429").wait_for()
    assert error.inner_text().startswith("429 Too many requests: the server is at its limit. "
                                         "Retry in 7 s.")
    c.page.locator(".msg.user").last.get_by_role("button", name="Retry").click()
    error.filter(has_text="503").wait_for()
    assert "Retry in 3 s." in error.inner_text()
    c.send("Once more?")
    error.filter(has_text="aborted").wait_for()
    assert c.last_reply().locator(".bubble").inner_text() == "Half"
    assert "The stream was aborted." in c.last_reply().locator(".error-text").inner_text()
    c.send("And the last?")
    error.filter(has_text="finish reason").wait_for()
    assert c.last_reply().locator(".bubble").inner_text() == "Cut"
    assert c.wait_reply_done()["finish"] == "finish error"


def histogram_text(counts_by_gateway: dict[str, list[int]]) -> str:
    """TTFT buckets (0.1, 0.5, 1, +Inf) as each gateway of a tier exposes them."""
    lines = []
    for gateway, counts in counts_by_gateway.items():
        for le, count in zip(["0.1", "0.5", "1.0", "+Inf"], counts, strict=True):
            lines.append(f'zeroserve:time_to_first_token_seconds_bucket{{gateway="{gateway}",'
                         f'le="{le}",model_name="a \\"quoted\\" name"}} {count}.0')
    return "# HELP x y\n" + "\n".join(lines) + "\n"


def test_the_pages_parsers_read_what_the_gateway_writes(console):
    """The page's own code, run in the browser: Prometheus text summed over a tier's
    gateways, histogram quantiles between two scrapes as PromQL's histogram_quantile, and
    SSE events split anywhere across network reads."""
    c = console()
    older = histogram_text({"0": [0, 0, 0, 0], "1": [1, 1, 1, 1]})
    newer = histogram_text({"0": [6, 50, 55, 55], "1": [5, 41, 46, 46]})
    result = c.page.evaluate("""async ([older, newer]) => {
        const m = await import("/ui/metrics.js");
        const api = await import("/ui/api.js");
        const a = m.parsePrometheus(older), b = m.parsePrometheus(newer);
        const name = "zeroserve:time_to_first_token_seconds";
        const parts = ['data: {"a"', ':1}\\r\\n', '\\r\\ndata: {"b":2}\\n', '\\ndata: [DO', 'NE]\\n\\n',
                       'data: {"after": "done"}\\n\\n'];
        const body = new ReadableStream({ start(controller) {
            for (const p of parts) controller.enqueue(new TextEncoder().encode(p));
            controller.close(); } });
        const events = [];
        for await (const data of api.sseData(new Response(body))) events.push(data);
        return {
            label: b.samples[0].labels.model_name,
            p50: m.quantileBetween(a, b, name, 0.5), p99: m.quantileBetween(a, b, name, 0.99),
            none: m.quantileBetween(a, a, name, 0.5), reset: m.quantileBetween(b, a, name, 0.5),
            events,
        };
    }""", [older, newer])
    assert result["label"] == 'a "quoted" name'
    # 100 new observations: 10 under 0.1 s, 90 under 0.5 s, all under 1 s.
    assert result["p50"] == pytest.approx(0.1 + 0.4 * (50 - 10) / 80)
    assert result["p99"] == pytest.approx(0.5 + 0.5 * (99 - 90) / 10)
    assert result["none"] is None and result["reset"] is None
    assert result["events"] == ['{"a":1}', '{"b":2}']


# --- operations ----------------------------------------------------------------------------

def test_the_workers_table_lists_both_workers_and_offers_actions_only_to_admins(console, server):
    c = console("ops")
    for worker in server.workers():
        c.wait_status(worker["worker_id"], "ready")
        assert c.row(worker["worker_id"]).locator("td").nth(2).inner_text() == str(worker["pid"])
    # With an admin key set on the server, the page without it is read-only, and says so.
    assert c.page.locator("#workers button").count() == 0
    assert c.page.is_hidden("#rolling-restart")
    assert "Read-only" in c.page.inner_text("#ops-note")
    c.set_keys(admin="wrong-key")
    c.page.wait_for_timeout(1500)
    assert c.page.locator("#workers button").count() == 0
    c.set_keys(admin=ADMIN_KEY)
    c.row("worker-0").locator("button[data-action=drain]").wait_for()
    assert c.page.is_visible("#rolling-restart")
    assert c.page.locator("#workers tbody tr").count() == 2


def test_the_workers_table_shows_each_workers_kv_tier(console, server):
    """The KV tier column: "off" for the fake backend's workers (no KV pool, no tier); the
    page's own cell code, run in the browser, shows a worker with a tier as on with its hits
    and misses (the rest in the tooltip), and one whose first report is still to come as on."""
    c = console("ops")
    for worker in server.workers():
        c.wait_status(worker["worker_id"], "ready")
        cell = c.row(worker["worker_id"]).locator("[data-tier]")
        assert (cell.get_attribute("data-tier"), cell.inner_text()) == ("off", "off")
    assert "KV tier" in c.page.inner_text("#workers thead")
    cells = c.page.evaluate("""async () => {
        const ops = await import("/ui/ops.js");
        return [
            ops.tierCell({kv_tier_id: "a1b2c3d4e5f60718", kv_tier: {
                hits: 42, misses: 3, read_bytes: 15 * 2 ** 20, written_bytes: 7 * 2 ** 20,
                evictions: 2, load_microseconds: 10500}}),
            ops.tierCell({kv_tier_id: "a1b2c3d4e5f60718", kv_tier: null}),
            ops.tierCell({kv_tier: null}),
        ];
    }""")
    on, fresh, off = cells
    assert (on["state"], on["text"]) == ("on", "on · 42 hits / 3 misses")
    assert on["title"].split("\n") == [
        "KV tier a1b2c3d4e5f60718", "42 blocks loaded, 3 lookups missed",
        "15.0 MiB read, 7.0 MiB written", "2 evicted, 10.5 ms loading"]
    assert (fresh["state"], fresh["text"]) == ("on", "on · 0 hits / 0 misses")
    assert (off["state"], off["text"]) == ("off", "off")


def test_drain_then_undrain_from_the_page(console, server):
    c = console("ops")
    c.set_keys(admin=ADMIN_KEY)
    c.row("worker-0").locator("button[data-action=drain]").wait_for()
    # Cancelling the confirmation does nothing.
    c.row("worker-0").locator("button[data-action=drain]").click()
    c.page.click("#confirm-cancel")
    c.page.wait_for_timeout(1200)
    assert c.status("worker-0") == "ready"

    c.confirm_action("worker-0", "drain")
    c.wait_status("worker-0", "draining")
    assert {w["worker_id"]: w["status"] for w in server.workers()}["worker-0"] == "draining"
    c.confirm_action("worker-0", "undrain")
    c.wait_status("worker-0", "ready")
    assert {w["worker_id"]: w["status"] for w in server.workers()}["worker-0"] == "ready"
    assert "drain worker-0: sent." in c.page.inner_text("#events")


def test_a_killed_worker_restarts_while_a_chat_reply_keeps_streaming(console, server):
    ops = console("ops")
    ops.set_keys(admin=ADMIN_KEY)
    chat = console("chat")
    for worker in server.workers():
        ops.wait_status(worker["worker_id"], "ready")
    chat.settings(max_tokens=250)  # about 5 s at 20 ms a step
    chat.send("Keep talking while a worker dies.")
    chat.wait_streaming()
    busy = next(w for w in server.workers() if w["num_in_flight"] > 0)
    os.kill(busy["pid"], signal.SIGKILL)

    # The table shows the restart (the row as restarting, or the new process flagged as
    # restarted), then the worker ready again as a new process.
    ops.page.wait_for_function(
        "id => !!document.querySelector(`#workers tr[data-worker='${id}']`)"
        "?.querySelector('[data-status=restarting], .badge')", arg=busy["worker_id"])
    ops.page.wait_for_function(
        "([id, pid]) => { const row = document.querySelector(`#workers tr[data-worker='${id}']`);"
        " return row && row.querySelector('[data-status]').dataset.status === 'ready'"
        " && row.children[2].innerText !== String(pid); }", arg=[busy["worker_id"], busy["pid"]])
    assert "restarted" in ops.page.inner_text("#events")

    # The reply went on through the failover: all of it, no error.
    stats = chat.wait_reply_done()
    assert stats["completion"] == "tokens 250" and stats["finish"] == "finish length"
    assert chat.last_reply().locator(".error-text").count() == 0
    assert chat.page.is_hidden("#chat-error")
    server.workers()  # records the new pid for teardown
    ops.page.wait_for_timeout(1500)  # one more scrape: the charts show the stream and the mark
    ops.screenshot("operations.png")


def test_rolling_restart_from_the_page(console, server):
    c = console("ops")
    c.set_keys(admin=ADMIN_KEY)
    before = {w["worker_id"]: w["pid"] for w in server.workers()}
    assert len(before) == 2
    for worker_id in before:
        c.wait_status(worker_id, "ready")
    c.page.click("#rolling-restart")
    c.page.locator("#confirm[open]").wait_for()
    assert "one at a time" in c.page.inner_text("#confirm-text")
    c.page.click("#confirm-ok")
    c.page.locator("#events li", has_text="Rolling restart done").wait_for(timeout=90_000)
    after = {w["worker_id"]: w["pid"] for w in server.workers()}
    assert all(after[w] != before[w] for w in before), (before, after)
    assert all(w["status"] == "ready" for w in server.workers())


# --- access and connection -----------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(module_servers):
    # The harness reads /health's worker list, which a caller without the key does not get:
    # wait on readiness instead (open to probes).
    server = module_servers(args=("--backend", "fake", "--device", "cpu", "--workers", "1",
                                  "--fake-forward-ms", "5", "--api-key", API_KEY), wait=False)
    deadline = time.monotonic() + 120
    while not is_ready(server.url):
        assert time.monotonic() < deadline and server.process.poll() is None, server.log_tail()
        time.sleep(0.25)
    return server


def live_gateway_pid(url: str) -> int | None:
    request = urllib.request.Request(url + "/health/live",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return json.loads(response.read())["pid"]
    except OSError:
        return None


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_with_api_keys_the_page_asks_for_one_and_then_works(console, keyed_server):
    c = console(url=keyed_server.url)
    note = c.page.locator("#model-note")
    note.filter(has_text="401").wait_for()
    assert "API key" in note.inner_text()
    c.settings(max_tokens=20)
    c.send("Hello?")
    error = c.page.locator("#chat-error")
    error.wait_for()
    assert error.inner_text().startswith("401 Unauthorized: this server needs an API key")
    assert "attention" in c.page.get_attribute("#open-keys", "class")

    c.set_keys(api=API_KEY)
    c.page.locator("#model option").first.wait_for(state="attached")
    c.send("Hello again?")
    assert c.wait_reply_done()["completion"] == "tokens 20"
    assert c.page.is_hidden("#chat-error")
    # The key stays in headers: never in the page's address, nor in the server's log.
    assert API_KEY not in c.page.url
    assert API_KEY not in keyed_server.log_path.read_text(errors="replace")

    c.tab("ops")
    c.row("worker-0").locator("[data-status=ready]").wait_for()


def test_a_gateway_briefly_gone_is_said_and_reconnected(console, keyed_server):
    c = console(url=keyed_server.url)
    c.set_keys(api=API_KEY)
    c.page.locator("#conn.pill-ok").wait_for()
    ops = console("ops", url=keyed_server.url)
    ops.set_keys(api=API_KEY)
    ops.page.locator("#ops-updated", has_text="live").wait_for()
    gateway_pid = live_gateway_pid(keyed_server.url)
    banner = c.page.locator("#banner")

    # Stalled (SIGSTOP): connections are accepted and nothing answers.
    os.kill(gateway_pid, signal.SIGSTOP)
    try:
        banner.filter(has_text="does not answer").wait_for()
        assert c.page.inner_text("#conn") == "disconnected"
        ops.page.locator("#ops-updated", has_text="stale").wait_for()
    finally:
        os.kill(gateway_pid, signal.SIGCONT)
    banner.filter(has_text="Reconnected").wait_for()
    assert c.page.inner_text("#conn") == "connected"
    ops.page.locator("#ops-updated", has_text="live").wait_for()

    # Gone (SIGKILL): `serve` starts a new gateway; the page carries on with it.
    os.kill(gateway_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while live_gateway_pid(keyed_server.url) in (None, gateway_pid):
        assert time.monotonic() < deadline, "serve did not start a new gateway"
        time.sleep(0.25)
    c.page.locator("#conn.pill-ok").wait_for()
    c.settings(max_tokens=10)
    c.send("Are you back?")
    assert c.wait_reply_done()["completion"] == "tokens 10"


# --- structured output (the real model) ----------------------------------------------------

@pytest.fixture(scope="module")
def model_server(real_model_server):
    return real_model_server  # the session's (tests/e2e/conftest.py)


def test_a_json_schema_reply_parses(console, model_server):
    c = console(url=model_server.url)
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    c.settings(max_tokens=40, schema=json.dumps(schema))
    assert "constrained" in c.page.inner_text("#schema-note")
    c.send("Name a city and say whether it is sunny there.")
    stats = c.wait_reply_done(timeout_ms=120_000)  # a real model on a busy CPU
    assert stats["json"] == "valid JSON"
    reply = json.loads(c.last_reply().locator(".bubble").inner_text())
    assert set(reply) == {"city", "sunny"} and isinstance(reply["sunny"], bool)
