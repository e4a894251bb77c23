"""Chat templates: the model's own jinja2 template, rendered in a sandbox.

The environment matches what Hugging Face's `apply_chat_template` gives templates
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, a non-escaping `tojson`,
`strftime_now`), so a template renders here exactly as it does there.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# SmolLM-style ChatML, for models whose files carry no template.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def read_template_file(path: str | Path) -> str:
    """`--chat-template FILE`: a jinja2 file, or a tokenizer_config.json (or any JSON object)
    whose "chat_template" holds one. Raises ChatTemplateError with what is wrong."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template {path}: {e}") from None
    if Path(path).suffix == ".json":
        try:
            source = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            source = None
        if not isinstance(source, str):
            raise ChatTemplateError(f"{path} has no \"chat_template\" string")
        text = source
    try:
        ChatTemplate(text)  # compile now: a broken template fails at start, not per request
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{path}: line {e.lineno}: {e.message}") from None
    return text


class ChatTemplate:
    @classmethod
    def from_tokenizer(cls, tokenizer, template_file: str | None = None) -> ChatTemplate:
        """The template a tokenizer carries (ours or transformers'), or the one in
        `template_file` instead, with the tokenizer's bos/eos."""
        source = tokenizer.chat_template if template_file is None \
            else read_template_file(template_file)
        return cls(source, tokenizer.bos_token, tokenizer.eos_token)

    def __init__(self, source: str | None, bos_token: str | None = None,
                 eos_token: str | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source or FALLBACK_TEMPLATE
        self.template = env.from_string(self.source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **extra: Any) -> str:
        """continue_final_message: the text ends right after the final message's content
        (no end of turn), for the model to go on with it."""
        if continue_final_message:
            return self._render_open(messages, **extra)
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
        except Exception as e:  # a template is code; its failures are about the input
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def _render_open(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        """The conversation cut right after the final message's content. A marker appended
        to that content shows where it ends, whatever the template writes after it (and
        even when the content is empty or also appears elsewhere in the text)."""
        marker = f"<<continue-{uuid.uuid4().hex}>>"
        final = {**messages[-1], "content": messages[-1]["content"] + marker}
        text = self.render([*messages[:-1], final], add_generation_prompt=False, **extra)
        end = text.rfind(marker)
        if end < 0:
            raise ChatTemplateError("continue_final_message: the chat template does not "
                                    "show the final message's content as given")
        return text[:end].replace(marker, "")
