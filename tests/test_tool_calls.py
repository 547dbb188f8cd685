"""Tool calls without a model run: reading calls out of output as it streams (every way
it may be cut into deltas), a chat's tool history as the prompt, and which tool_choice a
chat template allows. The served round trip is in test_openai_client.py."""

from __future__ import annotations

import json
import random

import pytest

from api.chat_prompt import chat_prompt_ids
from api.protocol import ChatMessage, ChatRequest
from api.reasoning import think_first
from api.sampling import structure_of
from api.tool_reader import HERMES, LLAMA, CallReader
from api.tools import ToolCalls, tool_calls
from pipeline.errors import InvalidRequest
from pipeline.tokenizer import Tokenizer
from tests.harness import tokenizer_with_template
from tests.test_api_validation import CHAT, assert_openai_error, serving
from workers.scheduler.grammar import Grammars

TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Pa}ris", "at": {"day": 1}}}\n</tool_call>\n<tool_call>\n'
             '{"name": "now", "arguments": {}}\n</tool_call>')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}


@pytest.fixture
async def client(redis_url, prefix, model_files):
    async with serving(redis_url, prefix, model_files) as client:
        yield client


def read_in_pieces(text: str, reader: CallReader, rng: random.Random) -> tuple[str, dict]:
    """The content and calls a client assembles from the streamed deltas."""
    deltas, at = [], 0
    while at < len(text):
        size = rng.randint(1, 6)
        deltas.append(reader.read(text[at:at + size], last=at + size >= len(text)).delta())
        at += size
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"arguments": ""})
            call.update({key: piece[key] for key in ("id", "type") if key in piece})
            call["name"] = piece["function"].get("name", call.get("name"))
            call["arguments"] += piece["function"]["arguments"]
    return content, calls


def test_calls_read_in_any_pieces_are_the_calls_read_whole():
    rng = random.Random(7)
    for _ in range(100):
        reader = CallReader()
        content, calls = read_in_pieces(TWO_CALLS, reader, rng)
        assert content == reader.content == "Let me look."
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("get_weather", '{"city": "Pa}ris", "at": {"day": 1}}'), ("now", "{}")]
        assert [c["id"] for c in calls.values()] == [c["id"] for c in reader.calls]
        assert [c["function"]["arguments"] for c in reader.calls] == [
            c["arguments"] for c in calls.values()]


def test_llama_3_calls_are_read_by_their_braces():
    """Llama 3's format has no tags: a call is the bare object, its end the brace that
    closes it (braces in strings do not count); calls are separated by "; "."""
    rng = random.Random(11)
    output = ('Checking. {"name": "get_weather", "parameters": {"city": "{Rome}", '
              '"days": [1, 2]}}; {"name": "now", "parameters": {}}')
    for _ in range(100):
        reader = CallReader(LLAMA)
        content, calls = read_in_pieces(output, reader, rng)
        assert content == "Checking."
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("get_weather", '{"city": "{Rome}", "days": [1, 2]}'), ("now", "{}")]
    for text in ('No call: {"nam', '{"name": "Ann", "age": 3} is JSON, not a call.',
                 '{"name": "' + "x" * 300 + '"}'):
        for _ in range(30):
            assert read_in_pieces(text, CallReader(LLAMA), rng) == (text, {})


def test_each_formats_structures_compile(model_files):
    """The structural tags tool calls are held by, for both formats and every choice."""
    grammars = Grammars(model_files.path, 49152, [2])
    tools = (("get_weather", json.dumps(WEATHER["function"]["parameters"])), ("now", "{}"))
    for form in (HERMES, LLAMA):
        for calls in (ToolCalls(tools, form=form), ToolCalls(tools, required=True, form=form),
                      ToolCalls(tools, required=True, parallel=False, form=form),
                      ToolCalls(tools, name="now", form=form)):
            assert grammars.compile(calls.structure()) is not None


def test_text_that_only_looks_like_a_call_is_content():
    rng = random.Random(8)
    text = "Hello <tool world </tool_call> {\"name\": 1}  "
    for _ in range(30):
        assert read_in_pieces(text, CallReader(), rng) == (text, {})


def test_a_named_functions_output_is_its_arguments_as_they_come():
    reader = CallReader(name="add")
    first = reader.read('{"a": ')
    [opening] = first.delta()["tool_calls"]
    assert opening["function"] == {"name": "add", "arguments": '{"a": '}
    assert opening["index"] == 0 and opening["id"].startswith("call_")
    assert reader.read('1, "b": "}"}', last=True).delta() == {
        "tool_calls": [{"index": 0, "function": {"arguments": '1, "b": "}"}'}}]}


@pytest.mark.parametrize(("output", "content", "arguments"), [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", '{"a": 1}'),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool', "", '{"a": 1}'),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1', "", '{"a": 1'),
    ('<tool_call>\n{"name": "f', '<tool_call>\n{"name": "f', None),
])
def test_a_call_cut_short_keeps_what_it_said(output, content, arguments):
    """Cut by max_tokens: arguments as far as they went; before the name, text."""
    rng = random.Random(9)
    for _ in range(20):
        said, calls = read_in_pieces(output, CallReader(), rng)
        assert said == content
        assert [c["arguments"] for c in calls.values()] == ([] if arguments is None
                                                             else [arguments])


def test_finish_reasons_follow_openai():
    chosen = ToolCalls((("f", "{}"),))
    message, finish = chosen.message('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
                                     "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert chosen.message("Just text.", "stop") == (
        {"role": "assistant", "content": "Just text."}, "stop")
    named, finish = ToolCalls((("f", "{}"),), name="f").message('{"x": ', "length")
    assert named["tool_calls"][0]["function"]["arguments"] == '{"x": ' and finish == "length"


def test_tool_history_becomes_the_prompt_in_the_format_asked_for(model_files):
    """SmolLM2's template knows no tools: they are described in a system message, and
    past calls and their results are written out as the model is asked to write them."""
    tokenizer = Tokenizer(model_files.path)
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]]
    text = tokenizer.decode(chat_prompt_ids(messages, tokenizer, tools=[WEATHER]),
                            skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools") and '"get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
            "rain\n</tool_response><|im_end|>") in text


def test_a_template_that_knows_tool_calls_gets_them_as_transformers_passes_them(
        model_files, tmp_path):
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }} "
                "{{ c.function.arguments.city }}]{% endfor %}"
                "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}"
                "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}")
    tokenizer = tokenizer_with_template(model_files, tmp_path, template)
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"}]]
    text = tokenizer.decode(chat_prompt_ids(messages, tokenizer, tools=[WEATHER]))
    assert text == "assistant:[get_weather Oslo]|tool:snow(c1)|<get_weather>"
    # it shows tools, but not in the format this server reads: "auto" cannot be served
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [WEATHER]})
    with pytest.raises(InvalidRequest, match="auto"):
        tool_calls(body, tokenizer)
    required = tool_calls(body.model_copy(update={"tool_choice": "required"}), tokenizer)
    assert required is not None and required.required
    # one that asks for Llama 3's {"name": ..., "parameters": ...}: "auto" in that format
    llama = tokenizer_with_template(model_files, tmp_path, template + ' {"parameters": ...}')
    assert tool_calls(body, llama).form is LLAMA


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}],
     "messages[1].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{oops"}}]}], "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "[1]"}}]}], "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls"),
])
async def test_tool_history_of_the_wrong_shape_is_a_400(client, messages, param):
    response = await client.post(CHAT, json={"messages": messages, "tools": [WEATHER]})
    assert_openai_error(response, 400, "invalid_request", param)


def test_a_schema_xgrammar_refuses_is_named_by_the_field_it_came_from(model_files):
    """A named tool's parameters (held as a plain JSON schema) name tools; a
    response_format held after a reasoning model's thought (a structural tag) names
    response_format, as does a json_object."""
    grammars = Grammars(model_files.path, 49152, [2])
    bad = json.dumps({"type": "nope"})
    named = ToolCalls((("paint", bad),), name="paint").structure()
    answer = structure_of({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    for structure, field in ((named, "tools"), (think_first(answer, "before"), "response_format"),
                             (think_first(answer, "inside"), "response_format")):
        with pytest.raises(InvalidRequest, match="Unsupported type") as refused:
            grammars.compile(structure)
        assert refused.value.param == field
    assert structure_of({"type": "json_object"}).field == "response_format"
