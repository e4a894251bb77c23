"""`--chat-template FILE` replaces the model's chat template: a jinja2 file or a
tokenizer_config.json; a file that cannot be read or does not compile stops the start with a
usage error; `serve` hands it to its gateway; what /tokenize renders follows the file."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from tests.gateway.helpers import GatewayServer
from zeroserve.cli import main as cli
from zeroserve.gateway.text.chat_template import ChatTemplateError, read_template_file

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    return path


def test_jinja_and_tokenizer_config_files(template_file, tmp_path):
    assert read_template_file(template_file) == TEMPLATE
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "</s>", "chat_template": TEMPLATE}))
    assert read_template_file(config) == TEMPLATE


@pytest.mark.parametrize("name, content, message", [
    ("broken.jinja", "{% for m in messages %}", "line 1"),
    ("no-template.json", json.dumps({"eos_token": "</s>"}), 'no "chat_template"'),
    ("missing.jinja", None, "cannot read"),
])
def test_bad_files_are_clear_errors(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ChatTemplateError, match=message):
        read_template_file(path)
    result = CliRunner().invoke(cli.main, ["gateway", "--chat-template", str(path)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_serve_hands_the_file_to_its_gateway(template_file, monkeypatch):
    from zeroserve.cli.supervisor import Supervisor

    seen = {}
    monkeypatch.setattr(Supervisor, "run", lambda self: seen.setdefault(
        "children", [c.spec for c in self.children]) and 0)
    result = CliRunner().invoke(cli.main, ["serve", "--backend", "fake", "--device", "cpu",
                                           "--chat-template", str(template_file)], env={})
    assert result.exit_code == 0, result.output
    argv = list(seen["children"][0].argv)
    assert argv[argv.index("--chat-template") + 1] == str(template_file.resolve())


def test_the_file_replaces_the_models_template(template_file):
    messages = [{"role": "user", "content": "hi"}]
    with GatewayServer(chat_template=str(template_file)) as server:
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert bytes(ids).decode() == "<<user>>hi<<assistant>>"  # the byte tokenizer: id == byte
