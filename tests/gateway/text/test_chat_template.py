"""Chat templates render as transformers' apply_chat_template does."""

from __future__ import annotations

import pytest

from zeroserve.gateway.text.chat_template import ChatTemplate, ChatTemplateError
from zeroserve.gateway.text.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the GPU cross the road?"},
     {"role": "user", "content": "Why? 😀 日本語\n\nwith  spaces"}],
]


@pytest.fixture(scope="module")
def ours():
    tk = load_tokenizer("default")
    return tk, ChatTemplate.from_tokenizer(tk)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(ours, reference, messages, add_generation_prompt):
    tk, template = ours
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    assert text == expected
    # Token ids of the rendered prompt agree too (as the chat endpoint encodes them).
    expected_ids = reference.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt)
    if not isinstance(expected_ids, list):  # a BatchEncoding in newer transformers
        expected_ids = expected_ids["input_ids"]
    assert tk.encode(text, add_special_tokens=False) == list(expected_ids)


def test_smollm_default_system_prompt_is_added():
    source = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != "
              "'system' %}{{ 'SYS\n' }}{% endif %}{{ message['role'] + ': ' + "
              "message['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ 'assistant: ' }}{% endif %}")
    t = ChatTemplate(source)
    assert t.render([{"role": "user", "content": "hi"}]) == "SYS\nuser: hi\nassistant: "
    assert t.render([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                    add_generation_prompt=False) == "system: s\nuser: hi\n"


def test_bos_eos_and_raise_exception():
    source = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
              "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] }}{{ eos_token }}"
              "{% endfor %}")
    t = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert t.render([{"role": "user", "content": "a"}]) == "<s>a</s>"
    with pytest.raises(ChatTemplateError, match="no tools here"):
        t.render([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed():
    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_tojson_does_not_escape_html():
    t = ChatTemplate("{{ messages[0] | tojson }}")
    assert t.render([{"role": "user", "content": "<b>&"}]) == \
        '{"role": "user", "content": "<b>&"}'


def test_fallback_template_is_chatml():
    t = ChatTemplate(None)
    assert t.render([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
