"""Bad input never reaches a scheduler: every kind is a 4xx with an OpenAI-style body,
never a 500. A real app on the real Redis, no model run needed; the api never loads torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import httpx
import pytest
import redis.asyncio as aioredis

from api.app import CONFIG_ENV, app_from_env, create_app
from pipeline.config import ApiConfig, Config, RedisConfig
from pipeline.config_io import config_from_json, config_to_json
from pipeline.embedded_redis import EmbeddedRedis
from pipeline.errors import ConfigError
from pipeline.messages import FIELD, control_decoder, requests_decoder
from pipeline.streams import Keys
from pipeline.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello!"}]
CONTEXT = 8192  # SmolLM2-135M-Instruct's max_position_embeddings


@asynccontextmanager
async def serving(redis_url: str, prefix: str, model_files, **api):
    config = Config(redis=RedisConfig(url=redis_url, prefix=prefix), api=ApiConfig(**api))
    app = create_app(config, model_files)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


@pytest.fixture
async def client(redis_url, prefix, model_files):
    async with serving(redis_url, prefix, model_files, max_body_bytes=64 * 1024) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None,
                        param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


async def test_malformed_json_is_a_400_that_says_so(client):
    response = await client.post(CHAT, content=b'{"messages": [', headers={
        "content-type": "application/json"})
    error = assert_openai_error(response, 400, "invalid_request")
    assert "JSON" in error["message"]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"", b"a=b"])
async def test_a_body_that_is_not_a_json_object_is_a_400(client, body):
    assert_openai_error(await client.post(CHAT, content=body), 400, "invalid_request")


async def test_non_utf8_bytes_are_a_400(client):
    response = await client.post(COMPLETIONS, content=b'{"prompt": "\xff\xfe\xfa"}',
                                 headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "invalid_request")


@pytest.mark.parametrize(("path", "field", "value", "param"), [
    (COMPLETIONS, "max_tokens", "5", "max_tokens"),
    (COMPLETIONS, "max_tokens", True, "max_tokens"),
    (COMPLETIONS, "temperature", "hot", "temperature"),
    (COMPLETIONS, "n", 1.5, "n"),
    (COMPLETIONS, "stop", 5, "stop"),
    (COMPLETIONS, "stream", "yes", "stream"),
    (COMPLETIONS, "prompt", {"text": "hi"}, "prompt"),
    (CHAT, "messages", "Hello!", "messages"),
    (CHAT, "messages", [{"role": "wizard", "content": "hi"}], "messages[0].role"),
    (CHAT, "messages", [{"role": "user"}], "messages[0].content"),
    (CHAT, "messages", [{"role": "user", "content": [{"text": "hi"}]}],
     "messages[0].content"),
    (CHAT, "logprobs", 3, "logprobs"),
    (CHAT, "service_tier", "scale", "service_tier"),
    (COMPLETIONS, "service_tier", 1, "service_tier"),
])
async def test_wrong_types_are_400s_naming_the_field(client, path, field, value, param):
    body = {"prompt": "Hello", "messages": HELLO} | {field: value}
    assert_openai_error(await client.post(path, json=body), 400, "invalid_request", param)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("temperature", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("top_k", -2), ("min_p", 1.5),
    ("frequency_penalty", 3.0), ("presence_penalty", -2.5), ("repetition_penalty", 0.0),
    ("min_tokens", -1), ("n", 0), ("n", 9), ("stop", [""]), ("stop", ["x"] * 17),
    ("stop_token_ids", [10**9]), ("seed", 2**63), ("top_logprobs", 21),
])
async def test_out_of_range_params_are_400s_naming_the_field(client, field, value):
    body = {"messages": HELLO, field: value} | ({"logprobs": True} if field == "top_logprobs"
                                               else {})
    assert_openai_error(await client.post(CHAT, json=body), 400, "invalid_request", field)


async def test_nan_is_not_a_temperature(client):
    body = b'{"prompt": "Hello", "temperature": NaN}'
    assert_openai_error(await client.post(COMPLETIONS, content=body), 400, "invalid_request",
                        "temperature")


async def test_completions_logprobs_over_twenty_is_a_400(client):
    response = await client.post(COMPLETIONS, json={"prompt": "Hello", "logprobs": 21})
    assert_openai_error(response, 400, "invalid_request", "logprobs")


async def test_top_logprobs_without_logprobs_is_a_400(client):
    response = await client.post(CHAT, json={"messages": HELLO, "top_logprobs": 2})
    assert_openai_error(response, 400, "invalid_request", "top_logprobs")


async def test_an_unknown_model_is_a_404_model_not_found(client):
    for path in (CHAT, COMPLETIONS):
        body = {"model": "gpt-4o", "messages": HELLO, "prompt": "Hello"}
        assert_openai_error(await client.post(path, json=body), 404, "model_not_found", "model")


@pytest.mark.parametrize("model", [None, "SmolLM2-135M-Instruct"])
async def test_the_served_model_name_or_none_passes_the_model_check(client, model):
    # the request gets past the model check and fails on the next thing wrong with it
    body = {"messages": HELLO, "temperature": 9.0} | ({"model": model} if model else {})
    assert_openai_error(await client.post(CHAT, json=body), 400, "invalid_request",
                        "temperature")


async def test_a_prompt_longer_than_the_context_is_context_length_exceeded(client):
    response = await client.post(COMPLETIONS, json={"prompt": [1] * CONTEXT})
    assert_openai_error(response, 400, "context_length_exceeded", "prompt")
    long_chat = [{"role": "user", "content": "word " * CONTEXT}]
    response = await client.post(CHAT, json={"messages": long_chat})
    assert_openai_error(response, 400, "context_length_exceeded", "messages")


async def test_prompt_plus_max_tokens_over_the_context_is_context_length_exceeded(client):
    response = await client.post(COMPLETIONS, json={"prompt": [1] * 100, "max_tokens": CONTEXT})
    assert_openai_error(response, 400, "context_length_exceeded", "max_tokens")


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": []}, "messages"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [5, 10**9]}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", ""]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": [[5], [6, 10**9]]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": ["one"] * 65}, "prompt"),
])
async def test_empty_unknown_token_or_too_many_prompts_are_400s(client, path, body, param):
    assert_openai_error(await client.post(path, json=body), 400, "invalid_request", param)


@pytest.mark.parametrize("bias", [
    {"a": 1.0}, {"-3": 1.0}, {"": 0.0}, {"²": 1.0}, {"49152": 1.0}, {"42": 100.5}, {"42": -101},
    {str(i): 1.0 for i in range(301)},
])
async def test_a_logit_bias_off_the_vocabulary_or_range_is_a_400(client, bias):
    body = {"messages": HELLO, "logit_bias": bias}
    assert_openai_error(await client.post(CHAT, json=body), 400, "invalid_request", "logit_bias")


@pytest.mark.parametrize(("path", "extra", "param"), [
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"response_format": {}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format.json_schema"),
    ("/generate", {"sampling_params": {"json_schema": "{nope"}}, "sampling_params.json_schema"),
    ("/generate", {"sampling_params": {"json_schema": "[1]"}}, "sampling_params.json_schema"),
])
async def test_a_response_format_of_the_wrong_shape_is_a_400(client, path, extra, param):
    body = ({"text": "Hello"} if path == "/generate" else {"messages": HELLO}) | extra
    assert_openai_error(await client.post(path, json=body), 400, "invalid_request", param)


F = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [F], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"tools": [F, F], "tool_choice": "required"}, "tools"),
    ({"tools": [F], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
])
async def test_tool_calls_this_server_cannot_make_are_400s(client, extra, param):
    body = {"messages": HELLO} | extra
    assert_openai_error(await client.post(CHAT, json=body), 400, "invalid_request", param)


async def test_a_batched_prompt_over_the_context_names_its_place(client):
    response = await client.post(COMPLETIONS, json={"prompt": [[1] * 10, [1] * CONTEXT]})
    assert_openai_error(response, 400, "context_length_exceeded", "prompt[1]")


@pytest.mark.parametrize(("given", "kept"), [
    ("gw-7f3a/2026:12", True), ("x" * 128, True),
    ("x" * 129, False), ("has space", False), ("", False),
])
async def test_every_response_names_its_request(client, given, kept):
    """x-request-id: a gateway's own id comes back as it was sent, on errors too;
    one too long or with a space or control character is replaced by a fresh id."""
    headers = {"x-request-id": given} if given else {}
    for response in (await client.get("/v1/models", headers=headers),
                     await client.post(CHAT, json={"messages": []}, headers=headers)):
        answer = response.headers["x-request-id"]
        assert answer == given if kept else len(answer) == 32 and answer != given
    fresh = [(await client.get("/health")).headers["x-request-id"] for _ in range(2)]
    assert fresh[0] != fresh[1]


@pytest.mark.parametrize(("path", "extra", "param"), [
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
])
async def test_features_this_server_lacks_are_refused_not_ignored(client, path, extra, param):
    body = {"messages": HELLO, "prompt": "Hello"} | extra
    assert_openai_error(await client.post(path, json=body), 400, "invalid_request", param)


async def test_a_body_over_the_limit_is_a_413(client):
    huge = {"prompt": "x" * (65 * 1024)}
    assert_openai_error(await client.post(COMPLETIONS, json=huge), 413, "payload_too_large")


async def test_a_chunked_body_over_the_limit_is_a_413_without_a_content_length(client):
    async def chunks():
        for _ in range(100):
            yield b"x" * 1024

    response = await client.post(COMPLETIONS, content=chunks())
    assert_openai_error(response, 413, "payload_too_large")


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/nothing-here", 404, "not_found"),
    ("POST", "/v2/chat/completions", 404, "not_found"),
    ("GET", CHAT, 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
])
async def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(client, method, path,
                                                                        status, code):
    assert_openai_error(await client.request(method, path), status, code)


@pytest.mark.parametrize(("body", "param"), [
    ({}, None),
    ({"text": "hi", "input_ids": [1, 2]}, None),
    ({"text": ""}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "hi", "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": 3.0}}, "sampling_params.temperature"),
    ({"text": "hi", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT}},
     "sampling_params.max_new_tokens"),
])
async def test_native_generate_refuses_bad_input_naming_the_field(client, body, param):
    error = assert_openai_error(await client.post("/generate", json=body), 400)
    if param is not None:
        assert error["param"] == param


async def test_models_lists_the_served_model_with_its_context(client):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    [model] = response.json()["data"]
    assert model["id"] == "SmolLM2-135M-Instruct"
    assert model["object"] == "model" and model["max_model_len"] == CONTEXT


async def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(client):
    response = await client.get("/v1/models/SmolLM2-135M-Instruct")
    assert response.status_code == 200
    assert response.json() == (await client.get("/v1/models")).json()["data"][0]
    error = assert_openai_error(await client.get("/v1/models/org/other-model"), 404,
                                "model_not_found", "model")
    assert "org/other-model" in error["message"]


@pytest.mark.parametrize(("part", "param", "words"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
     "messages[1].content[1].type", "'image_url'"),
    ({"type": "input_audio"}, "messages[1].content[1].type", "'input_audio'"),
    ({"type": "text"}, "messages[1].content[1].text", "needs its text"),
])
async def test_a_content_part_the_model_cannot_read_is_refused_by_name(client, part, param,
                                                                     words):
    messages = [*HELLO, {"role": "user", "content": [{"type": "text", "text": "see"}, part]}]
    error = assert_openai_error(await client.post(CHAT, json={"messages": messages}), 400,
                                "invalid_request", param)
    assert words in error["message"]


async def test_health_is_200_and_every_response_names_its_frontend(client):
    response = await client.get("/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"
    frontend_id = response.headers["x-pipeline-frontend"]
    assert frontend_id == response.json()["frontend_id"]
    failed = await client.post(CHAT, json={"messages": []})
    assert failed.headers["x-pipeline-frontend"] == frontend_id


async def test_health_is_503_when_redis_goes_away(prefix, model_files):
    redis_server = EmbeddedRedis()
    url = redis_server.start()
    try:
        async with serving(url, prefix, model_files) as client:
            assert (await client.get("/health")).status_code == 200
            redis_server.stop()
            response = await client.get("/health")
            assert response.status_code == 503
            assert response.json()["status"] == "unavailable"
    finally:
        redis_server.stop()


async def test_a_keys_tier_is_the_most_urgent_its_requests_run_at(redis_url, prefix,
                                                                   model_files):
    """--api-key KEY:TIER,...: a request asking for a more urgent tier than its key's
    runs at its key's (its Submit goes down that lane), a less urgent one as asked; a
    key naming no tier may ask for any. (No scheduler here: each ends in a 408.)"""
    asks = [("k-flex", "priority"), ("k-flex", None), ("k-std", "priority"),
            ("k-std", "flex"), ("k-any", "priority"), ("k-any", None)]
    async with serving(redis_url, prefix, model_files, request_timeout_s=0.3,
                       api_key="k-flex:flex,k-std:default,k-any") as client:
        for key, tier in asks:
            body = {"prompt": "hi", "max_tokens": 1} | ({"service_tier": tier} if tier else {})
            response = await client.post("/v1/completions", json=body,
                                         headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 408, response.text
        generated = await client.post("/generate", json={"text": "hi"},
                                      headers={"authorization": "Bearer k-flex"})
        assert generated.status_code == 408
    keys, store = Keys(prefix), aioredis.Redis.from_url(redis_url)
    try:
        lengths = {tier: await store.xlen(keys.lane(tier))
                   for tier in ("priority", "default", "flex")}
    finally:
        await store.aclose()
    assert lengths == {"priority": 1, "default": 2, "flex": 4}
    with pytest.raises(ConfigError, match="'gold' is no service tier"):
        create_app(Config(api=ApiConfig(api_key="k:gold")), model_files)


async def test_health_generate_is_503_when_no_scheduler_answers(redis_url, prefix, model_files):
    """No scheduler here: the probe's token never comes, so by the api's request
    timeout (shorter than the probe's own 20 s) it is a 503 saying so."""
    async with serving(redis_url, prefix, model_files, request_timeout_s=0.5) as client:
        response = await client.get("/health_generate")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"
    assert "timeout" in response.json()["detail"]


@pytest.mark.parametrize("n", [1, 2], ids=["one-choice", "two-choices"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_request_nobody_answers_is_a_408_by_its_deadline_and_is_cancelled(
        redis_url, prefix, model_files, n, stream):
    """No scheduler here: the frontend's deadline (an event in the request's queue,
    both for one choice read in the response's task and for several merged) gives
    the client a 408 in time, and the schedulers a Cancel for every choice. Each
    choice's Submit carries the client's x-request-id for the schedulers' logs."""
    async with serving(redis_url, prefix, model_files, request_timeout_s=0.3) as client:
        started = time.monotonic()
        async with asyncio.timeout(10):  # not forever, if the deadline is lost
            response = await client.post(COMPLETIONS, json={"prompt": "Hi", "n": n,
                                                            "stream": stream},
                                         headers={"x-request-id": "trace-408"})
        seconds = time.monotonic() - started
        assert_openai_error(response, 408, "timeout")
        assert 0.3 <= seconds < 5.0
        redis = aioredis.Redis.from_url(redis_url)
        try:
            for _ in range(50):  # the Cancels go out from the frontend's own tasks
                entries = await redis.xrange(Keys(prefix).control)
                cancelled = [request_id for _, fields in entries
                             for request_id in control_decoder.decode(fields[FIELD]).request_ids]
                if len(cancelled) == n:
                    break
                await asyncio.sleep(0.05)
            submits = [requests_decoder.decode(fields[FIELD])
                       for _, fields in await redis.xrange(Keys(prefix).requests)]
        finally:
            await redis.aclose()
        assert [s.trace_id for s in submits] == ["trace-408"] * n
        assert len({c.rsplit("-", 1)[0] for c in cancelled}) == 1  # one request's choices
        assert sorted(c.rsplit("-", 1)[1] for c in cancelled) == [str(i) for i in range(n)]


async def test_an_api_key_is_required_everywhere_but_health(redis_url, prefix, model_files):
    async with serving(redis_url, prefix, model_files, api_key="s3cret") as client:
        assert (await client.get("/health")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/nowhere")):
                response = await client.request(method, path, headers=headers, json={})
                assert_openai_error(response, 401, "unauthorized")
        good = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        response = await client.post(CHAT, headers=good, json={"messages": []})
        assert_openai_error(response, 400, "invalid_request", "messages")


async def test_any_of_several_api_keys_is_accepted(redis_url, prefix, model_files):
    """KEY,KEY: during a rotation both the old key and the new one work."""
    async with serving(redis_url, prefix, model_files, api_key="old-key,new-key") as client:
        for key, status in (("old-key", 200), ("new-key", 200), ("old-key,new-key", 401),
                            ("other", 401), ("", 401)):
            response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == status, key


async def test_browser_pages_from_allowed_origins_may_call_the_api(redis_url, prefix,
                                                                   model_files):
    """--allowed-origins: a browser's preflight is answered without the API key (it
    never carries one), and responses name the origin; other origins get nothing."""
    page, other = "https://app.example", "https://other.example"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    async with serving(redis_url, prefix, model_files, api_key="k",
                       allowed_origins=(page,)) as client:
        allowed = await client.options(CHAT, headers=preflight | {"Origin": page})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == page
        refused = await client.options(CHAT, headers=preflight | {"Origin": other})
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        listed = await client.get("/v1/models", headers={"Origin": page,
                                                         "Authorization": "Bearer k"})
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == page
        assert "x-request-id" in listed.headers["access-control-expose-headers"]
    async with serving(redis_url, prefix, model_files) as client:  # the default: no CORS
        listed = await client.get("/v1/models", headers={"Origin": page})
        assert listed.status_code == 200 and "access-control-allow-origin" not in listed.headers


def test_config_survives_a_json_round_trip():
    config = Config(model="/models/x", redis=RedisConfig(prefix="p", heartbeat_s=0.5),
                    api=ApiConfig(api_key="k", max_n=3, frontend_id=None))
    assert config_from_json(config_to_json(config)) == config
    assert config_from_json('{"api": {"port": 9001}}') == Config(api=ApiConfig(port=9001))
    with pytest.raises(ConfigError, match="port"):
        config_from_json('{"api": {"port": "many"}}')


def test_app_from_env_builds_the_app_from_the_config_variable(monkeypatch, model_files):
    config = Config(model=str(model_files.path), api=ApiConfig(max_n=2))
    monkeypatch.setenv(CONFIG_ENV, config_to_json(config))
    paths = set(app_from_env().openapi()["paths"])
    assert {CHAT, COMPLETIONS, "/v1/models", "/health", "/generate"} <= paths
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        app_from_env()


def test_the_api_process_never_imports_torch():
    code = ("import sys, api.app; from pipeline.config import Config; "
            "api.app.create_app(Config()); assert 'torch' not in sys.modules, 'torch loaded'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


async def test_tokenize_and_detokenize_use_the_served_tokenizer(client, model_files):
    tokenizer = Tokenizer(model_files.path)
    text = "The capital of France is Paris."
    response = await client.post("/tokenize", json={"prompt": text})
    assert response.status_code == 200, response.text
    ids = tokenizer.encode(text)
    assert response.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}
    back = await client.post("/detokenize", json={"tokens": ids, "model": "SmolLM2-135M-Instruct"})
    assert back.json() == {"prompt": text}
    # messages: the chat template's text, its assistant turn opened unless asked not to
    opened = (await client.post("/tokenize", json={"messages": HELLO})).json()
    closed = (await client.post("/tokenize", json={"messages": HELLO,
                                                   "add_generation_prompt": False})).json()
    assert opened["tokens"][:closed["count"]] == closed["tokens"]
    assert tokenizer.decode(opened["tokens"][closed["count"]:]).strip() == "assistant"


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": HELLO}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
async def test_bad_tokenize_requests_are_4xx(client, path, body, status, param):
    assert_openai_error(await client.post(path, json=body), status, param=param)
