"""A thinking model's <think> block told apart from its answer: read in any pieces,
found from the chat template, and shaped as chat `reasoning_content` (whole and
streamed, beside tool calls) and as a Responses reasoning item. The model here does
not think, so the outputs are written out; every part that handles them is real."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from api.protocol import ResponsesRequest
from api.reasoning import ThoughtReader, reasoning_start
from api.responses import Job, stream_chunks, whole_response
from api.responses_api import _events
from api.responses_output import finished
from api.streaming import Choice
from api.tools import ToolCalls
from pipeline.messages import Delta, Sampling
from pipeline.tokenizer import Tokenizer
from tests.harness import tokenizer_with_template

THOUGHT = "<think>\nThe user wants a color.\n</think>\n\nBlue."


def read_in_pieces(text: str, start: str, rng: random.Random) -> tuple[str, str]:
    reader, thought, answer, at = ThoughtReader(start), "", "", 0
    while at < len(text):
        size = rng.randint(1, 5)
        pieces = reader.read(text[at:at + size], last=at + size >= len(text))
        thought, answer, at = thought + pieces[0], answer + pieces[1], at + size
    assert (thought, answer) == (reader.reasoning, reader.content)
    return thought, answer


@pytest.mark.parametrize(("start", "output", "thought", "answer"), [
    ("before", THOUGHT, "The user wants a color.\n", "Blue."),
    ("inside", "Short.</think>Blue.", "Short.", "Blue."),
    ("before", "Blue, no thought.", "", "Blue, no thought."),
    ("before", "  <thin", "", "  <thin"),
    ("before", "<think>Cut short by max_tok", "Cut short by max_tok", ""),
    ("before", "<think>a </thinking> b</think>c", "a </thinking> b", "c"),
])
def test_a_thought_read_in_any_pieces_is_the_thought_read_whole(start, output, thought, answer):
    rng = random.Random(3)
    for _ in range(40):
        assert read_in_pieces(output, start, rng) == (thought, answer)


def test_the_chat_template_says_whether_and_where_a_model_thinks(model_files, tmp_path):
    assert reasoning_start(Tokenizer(model_files.path), [1, 2, 3]) is None  # SmolLM2
    opens = tokenizer_with_template(model_files, tmp_path, "{{ messages[0].content }}"
                                    "{% if add_generation_prompt %}<think>\n{% endif %}"
                                    "{# answers follow </think> #}")
    prompt = opens.encode(opens.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert reasoning_start(opens, prompt) == "inside"
    assert reasoning_start(opens, opens.encode("hi")) == "before"
    # Qwen3's enable_thinking false: the prompt closes an empty thought; none follows
    assert reasoning_start(opens, opens.encode("hi<think>\n\n</think>\n\n")) is None


def _job(**fields) -> Job:
    return Job(is_chat=True, response_id="chatcmpl-1", created=0, model="m", prompts=[[1]],
               samplings=[Sampling(max_tokens=64)], **fields)


def _run(coroutine_or_generator):
    async def drain():
        return [chunk async for chunk in coroutine_or_generator]
    return asyncio.run(drain())


async def _deltas(output: str, finish: str = "stop"):
    for at in range(0, len(output), 3):
        last = at + 3 >= len(output)
        yield 0, Delta("r", at, [at], output[at:at + 3], finish if last else None)


def test_chat_replies_carry_the_thought_as_reasoning_content(model_files):
    tokenizer = Tokenizer(model_files.path)
    call = '<tool_call>\n{"name": "paint", "arguments": {"color": "blue"}}\n</tool_call>'
    for job, output in ((_job(reasoning="before"), THOUGHT),
                        (_job(reasoning="before", tool_calls=ToolCalls((("paint", "{}"),))),
                         "<think>Paint it.</think>\n" + call)):
        choice = Choice(text=output, finish="stop")
        [whole] = whole_response(job, tokenizer, [choice])["choices"]
        chunks = _run(stream_chunks(job, tokenizer, _deltas(output)))
        deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == \
            whole["message"]["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == \
            (whole["message"]["content"] or "")
        if job.tool_calls is not None:
            [made] = whole["message"]["tool_calls"]
            assert json.loads(made["function"]["arguments"]) == {"color": "blue"}
            assert whole["message"]["reasoning_content"] == "Paint it."
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            assert whole["message"]["content"] == "Blue."


def test_a_response_puts_the_thought_in_a_reasoning_item(model_files):
    tokenizer = Tokenizer(model_files.path)
    job = _job(reasoning="before")
    body = ResponsesRequest(input="Name a color.")
    choice = Choice(text=THOUGHT, finish="stop", token_ids=tokenizer.encode(THOUGHT))
    whole = finished(job, body, choice, tokenizer)
    thought_tokens = whole["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert 0 < thought_tokens < whole["usage"]["output_tokens"]
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "The user wants a color.\n"
    assert whole["output"][1]["content"][0]["text"] == "Blue."
    events = _run(_events(job, body, _deltas(THOUGHT), tokenizer))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert [item["content"] for item in final["output"]] == [
        item["content"] for item in whole["output"]]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]


@pytest.mark.parametrize(("start", "output", "counted"), [
    ("before", THOUGHT, "thought"), ("inside", "Short.</think>Blue.", "thought"),
    ("inside", "Still thinking when cut", "all"), ("before", "Blue, no thought.", "none"),
    (None, THOUGHT, "none"),
])
def test_usage_counts_the_tokens_up_to_the_end_of_the_thought(model_files, start, output,
                                                              counted):
    """reasoning_tokens: up to the token that completes </think>; every token of a
    thought cut short; none where the model does not think or did not."""
    tokenizer = Tokenizer(model_files.path)
    ids = tokenizer.encode(output)
    job = _job(reasoning=start)
    usage = whole_response(job, tokenizer, [Choice(text=output, token_ids=ids,
                                                   finish="stop")])["usage"]
    made = usage["completion_tokens_details"]["reasoning_tokens"]
    if counted == "thought":
        assert "</think>" in tokenizer.decode(ids[:made], skip_special_tokens=False)
        assert "</think>" not in tokenizer.decode(ids[:made - 1], skip_special_tokens=False)
    else:
        assert made == {"all": len(ids), "none": 0}[counted]
