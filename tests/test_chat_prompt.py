"""A chat's prompt from its template: chat_template_kwargs reach the template, and a
template that fails on what it is given is a 400, never a 500."""

from __future__ import annotations

import pytest

from api.chat_prompt import chat_prompt_ids
from api.protocol import ChatMessage
from pipeline.errors import InvalidRequest
from tests.harness import tokenizer_with_template
from tests.test_api_validation import CHAT, HELLO, assert_openai_error, serving

QWEN3_LIKE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant:"
              "{% if enable_thinking is defined and not enable_thinking %} <think></think>"
              "{% endif %}{% endif %}")


@pytest.fixture
async def client(redis_url, prefix, model_files):
    async with serving(redis_url, prefix, model_files) as client:
        yield client


def test_chat_template_kwargs_reach_the_template(model_files, tmp_path):
    tokenizer = tokenizer_with_template(model_files, tmp_path, QWEN3_LIKE)
    messages = [ChatMessage(role="user", content="hi")]

    def text(kwargs):
        return tokenizer.decode(chat_prompt_ids(messages, tokenizer, template_kwargs=kwargs))

    assert text(None) == text({"enable_thinking": True}) == "user: hi\nassistant:"
    assert text({"enable_thinking": False}) == "user: hi\nassistant: <think></think>"
    with pytest.raises(InvalidRequest, match="cannot set messages") as refused:
        text({"messages": []})
    assert refused.value.param == "chat_template_kwargs"


def test_a_template_failing_on_its_values_is_a_400(model_files, tmp_path):
    tokenizer = tokenizer_with_template(model_files, tmp_path, "{{ messages[0].content + 1 }}")
    with pytest.raises(InvalidRequest, match="chat template failed"):
        chat_prompt_ids([ChatMessage(role="user", content="hi")], tokenizer)


async def test_reserved_chat_template_kwargs_are_a_400(client):
    response = await client.post(CHAT, json={"messages": HELLO,
                                             "chat_template_kwargs": {"tools": []}})
    assert_openai_error(response, 400, "invalid_request", "chat_template_kwargs")
    counted = await client.post("/tokenize", json={"messages": HELLO,
                                                   "chat_template_kwargs": {"x": 1}})
    assert counted.status_code == 200
