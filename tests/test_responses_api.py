"""/v1/responses through the OpenAI client on the session's tier: text, streamed
events, function calls and their outputs sent back, structured text, stored responses
continued (on another api), fetched, listed and deleted; and what it refuses, each a
400 naming the Responses field."""

from __future__ import annotations

import json
import signal
import time

import openai
import pytest
import redis

from pipeline.streams import Keys
from tests.test_api_validation import assert_openai_error, serving
from tests.test_openai_client import WEATHER

MODEL = "SmolLM2-135M-Instruct"
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def client(tier):
    return openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)


def test_a_response_is_the_chats_reply_as_a_message_item(client):
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a color."}])
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12,
                                       instructions="Be brief.", input="Name a color.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected


def test_a_streamed_response_is_the_whole_one_event_by_event(client):
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 16,
           "input": [{"role": "user", "content": [{"type": "input_text",
                                                   "text": "Count to five."}]}]}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_function_calls_and_their_outputs_go_round_the_loop(client):
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 40, "tools": [FLAT_WEATHER],
           "input": "What is the weather in Paris?"}
    called = client.responses.create(**ask, tool_choice="required", parallel_tool_calls=False)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "city" in json.loads(call.arguments) and call.call_id.startswith("call_")
    streamed = list(client.responses.create(**ask, tool_choice="required",
                                            parallel_tool_calls=False, stream=True))
    arguments = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert "".join(arguments) == call.arguments
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    with client.responses.stream(**ask, tool_choice="required",  # the SDK's own assembly
                                 parallel_tool_calls=False) as stream:
        [assembled] = stream.get_final_response().output
    assert (assembled.name, assembled.arguments) == (call.name, call.arguments)
    answer = client.responses.create(**ask | {"tool_choice": "none", "input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id,
         "output": "Sunny, 24 degrees."}]})
    assert answer.output_text and answer.output[0].type == "message"


def test_text_format_holds_the_output_to_a_schema(client):
    schema = {"type": "object", "properties": {"color": {"type": "string"}},
              "required": ["color"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=30, input="Name a color as JSON.",
        text={"format": {"type": "json_schema", "name": "color", "schema": schema}})
    assert set(json.loads(response.output_text)) == {"color"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": []}, "input"),
])
async def test_what_the_responses_api_cannot_do_is_a_400_naming_its_field(
        redis_url, prefix, model_files, body, param):
    async with serving(redis_url, prefix, model_files) as api:
        response = await api.post("/v1/responses", json=body)
    assert_openai_error(response, 400, param=param)


def test_a_stored_response_is_continued_on_any_api_fetched_listed_and_deleted(client, tier):
    """A response is stored by default: another api of the tier continues it by its id,
    as the client would by sending the conversation whole (the same reply, the same
    prompt), and finds it, its input items and, once deleted, no more of it."""
    first = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12,
                                    instructions="Be brief.", input="My name is Ada. Hi!")
    assert first.store
    with tier.extra_api() as (other_url, _proc):
        other = openai.OpenAI(base_url=f"{other_url}/v1", api_key="unused", timeout=120)
        then = other.responses.create(model=MODEL, temperature=0, max_output_tokens=12,
                                      previous_response_id=first.id,
                                      input="What is my name?")
    whole = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12,
                                    store=False, input=[  # instructions are not carried over
                                        {"role": "user", "content": "My name is Ada. Hi!"},
                                        {"role": "assistant", "content": first.output_text},
                                        {"role": "user", "content": "What is my name?"}])
    assert then.previous_response_id == first.id
    assert then.output_text == whole.output_text
    assert then.usage.input_tokens == whole.usage.input_tokens
    fetched = client.responses.retrieve(then.id)
    assert (fetched.id, fetched.output_text, fetched.usage) == (then.id, then.output_text,
                                                                then.usage)
    items = client.responses.input_items.list(then.id)  # the latest first
    assert [(i.type, i.role) for i in items.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[1].id == first.output[0].id and all(i.id for i in items.data)
    oldest = client.responses.input_items.list(then.id, order="asc", limit=1)
    assert [i.id for i in oldest.data] == [items.data[-1].id] and oldest.has_more
    ttl_ms = redis.Redis.from_url(tier.redis_url).pttl(Keys(tier.prefix).response(then.id))
    assert 0 < ttl_ms <= 3600 * 1000
    client.responses.delete(then.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(then.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, previous_response_id=then.id, input="Hi")
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store: false


def test_a_stored_response_belongs_to_the_api_key_that_stored_it(tier):
    """Under --api-key another key finds none of a key's stored responses, as if
    their ids were unknown: not to fetch, list, cancel, delete or continue; the key
    that stored one does."""
    with tier.extra_api(**{"api-key": "k-a,k-b"}) as (url, _proc):
        a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120)
                for key in ("k-a", "k-b"))
        mine = a.responses.create(model=MODEL, temperature=0, max_output_tokens=4, input="Hi")
        for look in (b.responses.retrieve, b.responses.input_items.list, b.responses.cancel,
                     b.responses.delete):
            with pytest.raises(openai.NotFoundError):
                look(mine.id)
        with pytest.raises(openai.BadRequestError) as refused:
            b.responses.create(model=MODEL, previous_response_id=mine.id, input="Hi")
        assert refused.value.body["param"] == "previous_response_id"
        assert a.responses.retrieve(mine.id).output_text == mine.output_text
        then = a.responses.create(model=MODEL, temperature=0, max_output_tokens=4,
                                  previous_response_id=mine.id, input="And?")
        assert a.responses.input_items.list(then.id).data
        a.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(mine.id)


def test_a_streamed_response_is_stored_as_its_last_event_shows_it(client):
    events = list(client.responses.create(model=MODEL, temperature=0, max_output_tokens=8,
                                          input="Name a fruit.", stream=True))
    last = events[-1].response
    assert last.store
    fetched = client.responses.retrieve(last.id)
    assert (fetched.output_text, fetched.status) == (last.output_text, last.status)


async def test_with_no_storing_a_continuation_is_a_400_saying_so(redis_url, prefix,
                                                                 model_files):
    async with serving(redis_url, prefix, model_files, response_ttl_s=0) as api:
        response = await api.post("/v1/responses", json={
            "input": "hi", "previous_response_id": "resp_1"})
        missing = await api.get("/v1/responses/resp_1")
    error = assert_openai_error(response, 400, param="previous_response_id")
    assert "--response-ttl-s 0" in error["message"]
    assert_openai_error(missing, 404, "not_found")


def _polled(client, response_id: str, timeout_s: float = 120.0):
    """The response once it has ended (or the last seen, past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    response = client.responses.retrieve(response_id)
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        response = client.responses.retrieve(response_id)
    return response


def test_a_background_response_runs_on_to_be_polled_or_cancelled(client):
    """background: queued at once, then found as it ended, the foreground reply; a long
    one cancelled mid-way (its generation stopped); only a background one may be."""
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 12, "input": "Name a color."}
    foreground = client.responses.create(**ask)
    queued = client.responses.create(**ask, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = _polled(client, queued.id)
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text)
    assert client.responses.cancel(done.id).status == done.status  # ended: as it was
    long = client.responses.create(model=MODEL, input="Tell a long story.", background=True,
                                   max_output_tokens=4000, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 60
    while client.responses.retrieve(long.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError):  # not ended yet: nothing to continue
        client.responses.create(**ask, previous_response_id=long.id)
    started = time.monotonic()
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and time.monotonic() - started < 5
    assert _polled(client, long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**ask, background=True, store=False)


def test_a_streamed_background_response_is_picked_up_where_its_stream_dropped(client, tier):
    """background with stream: a client that drops its stream after a few events picks it
    up on another api from its cursor, and nothing is lost or repeated; the whole stream
    replays from the start after the end; a response not made so is not streamed again."""
    first = client.responses.create(model=MODEL, input="Tell a story.", temperature=0,
                                    max_output_tokens=40, background=True, stream=True)
    head = [event for event, _ in zip(first, range(8), strict=False)]
    first.close()
    assert [event.type for event in head[:3]] == [
        "response.created", "response.queued", "response.in_progress"]
    assert head[0].response.status == "queued"
    response_id, cursor = head[0].response.id, head[-1].sequence_number
    with tier.extra_api() as (other_url, _proc):
        other = openai.OpenAI(base_url=f"{other_url}/v1", api_key="unused", timeout=120)
        rest = list(other.responses.retrieve(response_id, stream=True, starting_after=cursor))
    events = head + rest
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert rest[-1].type == "response.incomplete"  # 40 tokens of a story
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    ended = client.responses.retrieve(response_id)
    assert (ended.status, ended.output_text) == ("incomplete", text) and text
    replayed = list(client.responses.retrieve(response_id, stream=True))
    assert [event.model_dump() for event in replayed] == [event.model_dump() for event in events]
    foreground = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(foreground.id, stream=True)
    assert refused.value.body["param"] == "stream"


def test_a_streamed_background_response_ends_its_stream_when_cancelled_or_its_api_dies(
        client, tier):
    """A cancel ends the stream (and its replay) with response.cancelled; a stream whose
    api died ends, once its liveness key has expired, with response.failed."""
    long = {"model": MODEL, "input": "Tell a long story.", "background": True, "stream": True,
            "max_output_tokens": 4000, "extra_body": {"ignore_eos": True}}
    stream = client.responses.create(**long)
    response_id = next(iter(stream)).response.id
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    assert client.responses.cancel(response_id).status == "cancelled"
    last = list(stream)[-1]
    assert (last.type, last.response["status"]) == ("response.cancelled", "cancelled")
    assert list(client.responses.retrieve(response_id, stream=True))[-1].type \
        == "response.cancelled"
    with tier.extra_api() as (url, proc):
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        stream = other.responses.create(**long)
        response_id = next(iter(stream)).response.id
        stream.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    events = list(client.responses.retrieve(response_id, stream=True, starting_after=0))
    assert events[0].sequence_number == 1
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert [event.sequence_number for event in events] == list(range(1, len(events) + 1))



def test_a_background_response_whose_api_died_is_failed(client, tier):
    with tier.extra_api() as (url, proc):
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        long = other.responses.create(model=MODEL, input="Tell a long story.",
                                      background=True, max_output_tokens=4000,
                                      extra_body={"ignore_eos": True})
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ended = _polled(client, long.id, timeout_s=60)  # its liveness key expires first
    assert ended.status == "failed" and "stopped" in ended.error.message


def test_a_draining_api_records_the_background_responses_it_could_not_end(client, tier):
    """SIGTERM: the api lets its background responses run for its drain time (1 s here),
    then stops the rest, each recorded as failed at once (no liveness TTL waited for)."""
    with tier.extra_api(**{"drain-timeout-s": 1}) as (url, proc):
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        long = other.responses.create(model=MODEL, input="Tell a long story.",
                                      background=True, max_output_tokens=4000,
                                      extra_body={"ignore_eos": True})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # the record itself says so (a reader would also infer it from the api's absence)
    stored = redis.Redis.from_url(tier.redis_url).get(Keys(tier.prefix).response(long.id))
    ended = json.loads(stored)["response"]
    assert ended["status"] == "failed" and "stopped" in ended["error"]["message"]
