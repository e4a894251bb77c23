"""The web console's HTTP side (gateway/http/ui.py): what /ui serves, its security headers,
that the page loads nothing from elsewhere and runs no inline code, and --disable-ui.

The page's behaviour in a browser is tested in tests/e2e/test_console.py."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch

import pytest
from starlette.testclient import TestClient

from tests.gateway.helpers import byte_tokenizer
from zeroserve.cli.harness import REPO_ROOT
from zeroserve.gateway.app import build_app
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.http.ui import UI_DIR, load_ui_files

KEY = "sk-console-test"


def client(**config) -> TestClient:
    # No `with`: the lifespan (sockets, workers) is not needed to serve static files.
    return TestClient(build_app(GatewayConfig(port=0, **config), byte_tokenizer()),
                      base_url="http://localhost")


@pytest.fixture(scope="module")
def console() -> TestClient:
    return client()


def csp_directives(header: str) -> dict[str, str]:
    return dict(part.strip().split(" ", 1) for part in header.split(";"))


@pytest.mark.parametrize("path", ["/ui", "/ui/", "/ui/index.html"])
def test_the_page_is_served_with_a_strict_policy(console, path):
    r = console.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>zeroserve console</title>" in r.text
    policy = csp_directives(r.headers["content-security-policy"])
    assert policy["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src"):
        assert policy[directive] == "'self'", directive
    assert policy["frame-ancestors"] == "'none'" and policy["form-action"] == "'none'"
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["referrer-policy"] == "no-referrer"


def test_every_file_the_page_loads_is_served_from_here(console):
    html = console.get("/ui").text
    referenced = set(re.findall(r'(?:src|href)="(/ui/[^"]+)"', html))
    for name in (UI_DIR).glob("*.js"):  # ES module imports: "./x.js"
        referenced |= {f"/ui/{m}" for m in re.findall(r'from "\./([\w.-]+)"', name.read_text())}
    assert {"/ui/app.js", "/ui/style.css", "/ui/chat.js", "/ui/ops.js"} <= referenced
    media = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
    for path in referenced:
        r = console.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"] == media[path[path.rfind("."):]]
        assert "content-security-policy" in r.headers


def test_the_page_runs_no_inline_code_and_loads_nothing_from_elsewhere():
    """The policy forbids inline scripts and styles; the page must not need them. No CDN:
    everything it loads comes from the gateway, so it works offline."""
    html = (UI_DIR / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>", html):
        assert 'src="/ui/' in tag, tag
    assert not re.search(r"<script\b[^>]*>\s*[^<\s]", html), "an inline script"
    assert "<style" not in html and not re.search(r"\sstyle=", html)
    assert not re.search(r"\son[a-z]+=", html), "an inline event handler"
    for path in UI_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://", text), path.name
        if path.suffix == ".js":
            # Text from the model or the server is set as textContent, never parsed as HTML.
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, path.name
            assert "eval(" not in text and "new Function" not in text, path.name


def test_keys_are_sent_as_headers_never_in_a_url():
    api = (UI_DIR / "api.js").read_text()
    assert "headers.Authorization = `Bearer ${token}`" in api
    for path in UI_DIR.glob("*.js"):
        assert not re.search(r"[?&](api_)?key=", path.read_text()), path.name


def test_admin_posts_carry_a_json_type_and_a_custom_header():
    """Either defence against cross-site admin calls (a JSON content type, or a header a
    form cannot send) lets the console through."""
    api = (UI_DIR / "api.js").read_text()
    assert 'headers["Content-Type"] = "application/json"' in api
    assert 'headers["X-Zeroserve-Admin"] = "1"' in api


def test_unknown_files_are_404_in_the_api_error_shape(console):
    for path in ["/ui/nope.js", "/ui/ui.py", "/ui/..%2Fui.py", "/ui/%2e%2e/config.py"]:
        r = console.get(path)
        assert r.status_code == 404, path
        assert r.json()["error"]["message"] == "Not Found"


def test_only_the_console_folder_is_servable():
    files = load_ui_files()
    assert set(files) == {p.name for p in UI_DIR.iterdir() if p.suffix in (".html", ".js", ".css")}


def test_the_files_ship_in_the_package():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["zeroserve.gateway.http"]
    for path in UI_DIR.iterdir():
        assert any(fnmatch(f"ui/{path.name}", p) for p in patterns), path.name


def test_disable_ui_turns_it_off():
    off = client(disable_ui=True)
    for path in ["/ui", "/ui/", "/ui/app.js"]:
        assert off.get(path).status_code == 404, path


def test_with_api_keys_the_page_loads_but_its_data_needs_a_key():
    """The page is static and holds nothing; what it shows comes from the API, with keys."""
    keyed = client(api_keys=(KEY,))
    assert keyed.get("/ui").status_code == 200
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
