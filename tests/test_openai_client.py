"""The official openai package against a running tier, streaming and not."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from pipeline.streams import Keys
from pipeline.tokenizer import Tokenizer


def test_openai_client_streams_and_completes_identically(tier):
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    [model] = [m.id for m in client.models.list().data]
    assert client.models.retrieve(model).id == model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                           max_tokens=20)
    text = whole.choices[0].message.content
    assert "Paris" in text
    # /tokenize counts a chat's prompt as the tier did
    counted = httpx.post(f"{tier.base_url}/tokenize", json={"messages": messages}, timeout=30)
    assert counted.json()["count"] == whole.usage.prompt_tokens
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                            max_tokens=20, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream
                   if chunk.choices) == text
    legacy = client.completions.create(model=model, prompt="The capital of France is",
                                       max_tokens=5, temperature=0)
    assert legacy.choices[0].text and legacy.usage.completion_tokens <= 5


def test_a_batch_of_prompts_is_answered_choice_by_choice_in_openai_order(tier, model_files):
    """A completion's list of prompts (text or token ids) with n=2: choice i runs prompt
    i // n, each as it runs alone, streamed or not; usage counts each prompt once."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Roses are red,"]
    model = client.models.list().data[0].id
    alone = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0)
             for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=6,
                                      temperature=0)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    token_ids = [Tokenizer(model_files.path).encode(p) for p in prompts]
    texts = ["", "", ""]
    for chunk in client.completions.create(model=model, prompt=token_ids, max_tokens=6,
                                           temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [a.choices[0].text for a in alone]


def test_logit_bias_bans_a_token_and_forces_another(tier, model_files):
    """Through the OpenAI client, greedy: -100 on the answer's token takes it out of
    the text, +100 on another makes it every token (the fused argmax path is left)."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    tokenizer = Tokenizer(model_files.path)
    [paris] = tokenizer.encode(" Paris")
    banana = tokenizer.encode(" banana")[0]
    prompt = "The capital of France is"

    def complete(**extra) -> str:
        return client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                         max_tokens=3, temperature=0, **extra).choices[0].text

    assert complete().startswith(" Paris")
    assert not complete(logit_bias={str(paris): -100}).startswith(" Paris")
    assert complete(logit_bias={str(banana): 100}) == tokenizer.decode([banana] * 3)


def test_echo_leads_with_the_prompt_and_its_logprobs_as_transformers_has_them(
        tier, model_files):
    """echo with logprobs: the prompt's text, its tokens' logprobs (the first none)
    equal to transformers' fp32 ones, then the completion as it is without echo; the
    prompt was just run, so its cached blocks are computed again, not reused."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of"
    ask = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4,
           "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**ask).choices[0]
    echoed = client.completions.create(**ask, echo=True).choices[0]
    ids = Tokenizer(model_files.path).encode(prompt)
    assert len(ids) > 16 and echoed.text == prompt + plain.text
    logprobs, count = echoed.logprobs, len(ids)
    assert logprobs.tokens[count:] == plain.logprobs.tokens
    assert logprobs.token_logprobs[count:] == pytest.approx(plain.logprobs.token_logprobs,
                                                            abs=1e-4)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(model_files.path, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
    assert logprobs.token_logprobs[1:count] == pytest.approx(
        expected.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist(), abs=1e-3)
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]
    streamed = client.completions.create(**ask | {"logprobs": None}, echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.text


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                          "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_holds_a_chat_to_json_and_to_a_schema(tier):
    """json_schema: the reply parses and fits the schema, streamed or not; /generate's
    json_schema the same; json_object: JSON (or cut by max_tokens); a schema the
    scheduler cannot hold to is a 400 that says why."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    ask = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 60,
           "messages": [{"role": "user", "content": "Name a famous person and their age."}]}
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.chat.completions.create(**ask, response_format=schema).choices[0]
    person = json.loads(reply.message.content)
    assert reply.finish_reason == "stop" and set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    streamed = client.chat.completions.create(**ask, response_format=schema, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        reply.message.content)
    native = httpx.post(f"{tier.base_url}/generate", timeout=120, json={
        "text": "The capital of France as JSON:", "sampling_params": {
            "max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(PERSON)}})
    assert set(json.loads(native.json()["text"])) == {"name", "age"}
    loose = client.chat.completions.create(**ask, response_format={"type": "json_object"})
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(loose.choices[0].message.content), dict)
    else:
        assert loose.choices[0].message.content.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError, match="Unsupported type") as refused:
        client.chat.completions.create(**ask, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert refused.value.body["param"] == "response_format"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}


def streamed_calls(chunks) -> list[tuple[str, str]]:
    """(name, arguments) of each call, assembled from its streamed pieces as a client does."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
    return [tuple(call) for call in calls.values()]


def test_a_required_or_named_tool_call_comes_back_as_tool_calls(tier):
    """tool_choice naming a function, or "required": the reply is a call whose
    arguments fit the function's parameters, streamed piece by piece or whole; "none"
    replies."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    ask = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 60,
           "tools": [WEATHER, ADD],
           "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    add = {"type": "function", "function": {"name": "add"}}
    named = client.chat.completions.create(**ask, tool_choice=add).choices[0]
    [call] = named.message.tool_calls
    assert named.finish_reason == "stop" and named.message.content is None
    assert call.function.name == "add" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    chunks = [c for c in client.chat.completions.create(**ask, tool_choice=add, stream=True)
              if c.choices]
    assert streamed_calls(chunks) == [("add", call.function.arguments)]
    assert sum(bool(c.choices[0].delta.tool_calls) for c in chunks) > 2  # as they came
    one = ask | {"tool_choice": "required", "parallel_tool_calls": False}
    chosen = client.chat.completions.create(**one).choices[0]
    [(name, arguments)] = [(c.function.name, c.function.arguments)
                           for c in chosen.message.tool_calls]
    assert chosen.finish_reason == "tool_calls" and chosen.message.content is None
    keys = {"city"} if name == "get_weather" else {"a", "b"}
    assert name in ("get_weather", "add") and set(json.loads(arguments)) == keys
    chunks = [c for c in client.chat.completions.create(**one, stream=True) if c.choices]
    assert streamed_calls(chunks) == [(name, arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # parallel calls allowed (the default): this small model goes on calling until cut
    several = client.chat.completions.create(**ask, tool_choice="required").choices[0]
    assert several.message.tool_calls[0].function.arguments == arguments
    plain = client.chat.completions.create(**ask, tool_choice="none").choices[0]
    assert plain.message.content and not plain.message.tool_calls


def test_a_tool_loop_runs_to_an_answer(tier):
    """The agent loop: "auto" (the default with tools) lets the model answer or call;
    the call and its result go back as history, and the model answers from them."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    auto = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=question, tools=[WEATHER], temperature=0,
        max_tokens=40).choices[0]
    assert auto.finish_reason in ("stop", "tool_calls", "length")
    assert (auto.finish_reason == "tool_calls") == bool(auto.message.tool_calls)
    assert auto.message.content or auto.message.tool_calls
    for call in auto.message.tool_calls or []:
        assert call.function.name == "get_weather" and "city" in json.loads(
            call.function.arguments)
    history = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees Celsius."}]
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=history, tools=[WEATHER],
        tool_choice="none", temperature=0, max_tokens=30)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    counted = httpx.post(f"{tier.base_url}/tokenize", json={"messages": history}).json()
    assert answer.usage.prompt_tokens == counted["count"]  # "none": the tools not shown


def test_openai_client_sees_errors_as_openai_errors(tier):
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=60)
    try:
        client.chat.completions.create(model="no-such-model", messages=[
            {"role": "user", "content": "hi"}])
    except openai.NotFoundError as error:
        assert error.status_code == 404
    else:
        raise AssertionError("an unknown model must be refused")


@pytest.fixture(scope="module")
def renamed_url(tier):
    """A second api on the same tier that serves the model as "assistant" (and
    "smol")."""
    with tier.extra_api(**{"served-model-name": "assistant,smol"}) as (url, _):
        yield url


def test_a_served_model_name_is_what_clients_see_and_name(renamed_url):
    """--served-model-name: /v1/models lists its names, a request may give any
    of them and is answered as the first; the model's own name is refused."""
    client = openai.OpenAI(base_url=f"{renamed_url}/v1", api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == ["assistant", "smol"]
    assert client.models.retrieve("smol").id == "smol"
    answer = client.completions.create(model="smol", prompt="The capital of France is",
                                       max_tokens=3, temperature=0)
    assert answer.model == "assistant" and answer.choices[0].text
    with pytest.raises(openai.NotFoundError, match="'assistant' or 'smol'"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)


def test_usage_counts_the_prompt_tokens_a_scheduler_found_in_its_prefix_cache(tier):
    """A prompt sent again is computed from the prefix cache's full blocks: its usage
    says how many of its tokens were found there (OpenAI's cached_tokens), in every
    route's shape; a first sending found only what it shares with earlier prompts (a
    chat: its template's system prompt)."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": f"Note {uuid.uuid4().hex}: " + ", ".join(
        f"item {i} is {i * i}" for i in range(12)) + ". Which item is 49?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           temperature=0)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached < again.usage.prompt_tokens
    assert again.usage.prompt_tokens - cached <= 16  # its full blocks (the last computed)

    streamed = [chunk.usage for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}) if chunk.usage]
    assert streamed[0].prompt_tokens_details.cached_tokens == cached
    response = client.responses.create(model=model, input=messages, max_output_tokens=2)
    assert response.usage.input_tokens_details.cached_tokens == cached
    prompt = "Tell me " + messages[0]["content"]
    generated = [httpx.post(f"{tier.base_url}/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 2}}).json()["meta_info"]
        for _ in "ab"]
    assert generated[0]["cached_tokens"] < generated[1]["cached_tokens"]
    assert generated[1]["prompt_tokens"] - generated[1]["cached_tokens"] <= 16


def test_a_service_tier_sends_a_request_down_its_own_lane(tier):
    """service_tier picks the requests stream a request waits in (schedulers pull
    "priority" first, "flex" last); the response says which tier served it."""
    client = openai.OpenAI(base_url=f"{tier.base_url}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    redis_client = redis.Redis.from_url(tier.redis_url)
    keys = Keys(tier.prefix)

    def last_id(tier_name: str) -> str:
        return redis_client.xinfo_stream(keys.lane(tier_name))["last-generated-id"].decode()

    messages = [{"role": "user", "content": "Say hi."}]
    for name in ("flex", "priority"):
        before = last_id(name)
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                                service_tier=name)
        assert answer.service_tier == name and answer.choices[0].finish_reason
        assert last_id(name) != before  # its Submit went down that lane
    plain = httpx.post(f"{tier.base_url}/v1/completions", timeout=120, json={
        "prompt": "Hi", "max_tokens": 2, "service_tier": "auto"}).json()
    assert plain["service_tier"] == "default"
    response = client.responses.create(model=model, input="Say hi.", max_output_tokens=2,
                                       service_tier="flex")
    assert response.service_tier == "flex"
    redis_client.close()
