"""End to end through real processes: api -> requests -> scheduler -> tokens
-> detokenizer -> replies -> api, against transformers' own greedy output."""

from __future__ import annotations

import json

import httpx
import pytest

from pipeline.status import live_workers

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(model_files):
    """transformers' greedy continuation of each chat prompt, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_files.path)
    model = AutoModelForCausalLM.from_pretrained(model_files.path, dtype=torch.float32)
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        gen = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        new = gen[0, ids["input_ids"].shape[1]:]
        out[prompt] = tokenizer.decode(new, skip_special_tokens=True)
    return out


def chat_body(prompt: str, **extra) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": prompt}]} | extra


def read_sse(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def stream_chat(base_url: str, body: dict) -> tuple[list[str], list[dict]]:
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body | {"stream": True},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = read_sse(response)
    pieces = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    return pieces, events


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_equals_transformers_generate(tier, reference, prompt):
    response = httpx.post(f"{tier.base_url}/v1/chat/completions", json=chat_body(prompt),
                          timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == reference[prompt]
    assert body["usage"]["completion_tokens"] <= MAX_TOKENS
    pieces, _ = stream_chat(tier.base_url, chat_body(prompt))
    assert "".join(pieces) == reference[prompt]


def test_stream_deltas_join_to_the_non_streaming_text_with_usage(tier):
    body = chat_body("Tell me a short story about a cat.", max_tokens=40)
    whole = httpx.post(f"{tier.base_url}/v1/chat/completions", json=body, timeout=120).json()
    pieces, events = stream_chat(
        tier.base_url, body | {"stream_options": {"include_usage": True}})
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    assert len([p for p in pieces if p]) > 5  # really streamed, not one lump
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    # the same counts; of the prompt, the stream found whole's blocks in the prefix cache
    streamed, whole_usage = events[-1]["usage"], whole["usage"]
    cached = streamed.pop("prompt_tokens_details")["cached_tokens"]
    assert whole_usage.pop("prompt_tokens_details")["cached_tokens"] <= cached
    assert streamed == whole_usage


def test_multibyte_output_never_shows_a_replacement_character(tier):
    prompt = "안녕하세요 😀 안녕하세요 😀 안녕하세요 😀 안녕하세요 😀"
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    whole = httpx.post(f"{tier.base_url}/v1/completions", json=body, timeout=120).json()
    text = whole["choices"][0]["text"]
    assert any(ord(ch) > 0x7F for ch in text), text  # the prompt did yield multi-byte output
    with httpx.stream("POST", f"{tier.base_url}/v1/completions", json=body | {"stream": True},
                      timeout=120) as response:
        pieces = [c["text"] for e in read_sse(response) for c in e["choices"]]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_stop_string_ends_the_text_before_it(tier, reference):
    prompt = PROMPTS[0]
    full = reference[prompt]
    stop = full.split()[2]  # a word from the middle of the greedy answer
    body = chat_body(prompt, stop=[stop])
    text = httpx.post(f"{tier.base_url}/v1/chat/completions", json=body,
                      timeout=120).json()["choices"][0]["message"]["content"]
    assert text == full[: full.index(stop)]
    pieces, events = stream_chat(tier.base_url, body)
    assert "".join(pieces) == text
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == [
        "stop"]


def test_generate_route_returns_text_and_ids(tier, reference):
    prompt = PROMPTS[3]
    ids = httpx.post(f"{tier.base_url}/v1/chat/completions", json=chat_body(prompt),
                     timeout=120).json()
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8,
                                                                   "temperature": 0}}
    out = httpx.post(f"{tier.base_url}/generate", json=body, timeout=120).json()
    assert isinstance(out["text"], str) and out["text"]
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] <= 8
    assert ids["choices"][0]["message"]["content"] == reference[prompt]


def test_generate_returns_the_prompts_logprobs_from_logprob_start_len(tier):
    """SGLang's input_token_logprobs: the same figures /v1/completions' echo gives."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    body = {"text": prompt, "return_logprob": True, "logprob_start_len": 2,
            "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    meta = httpx.post(f"{tier.base_url}/generate", json=body, timeout=120).json()["meta_info"]
    echo = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    echoed = httpx.post(f"{tier.base_url}/v1/completions", json=echo,
                        timeout=120).json()["choices"][0]["logprobs"]
    count = meta["prompt_tokens"]
    assert [t[2] for t in meta["input_token_logprobs"]] == echoed["tokens"][2:count]
    assert [t[0] for t in meta["input_token_logprobs"]] == pytest.approx(
        echoed["token_logprobs"][2:count], abs=1e-4)
    assert all(len(top) == 1 for top in meta["input_top_logprobs"])
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 2
    too_far = body | {"logprob_start_len": count}
    response = httpx.post(f"{tier.base_url}/generate", json=too_far, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprob_start_len"


@pytest.fixture(scope="module")
def chunky_url(tier):
    """A second api on the same tier, whose streamed chunks carry 4 tokens each."""
    with tier.extra_api(**{"stream-interval": 4}) as (url, _):
        yield url


def stream_completion(base_url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body | {"stream": True},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        return read_sse(response)


def test_a_stream_interval_of_4_sends_4_tokens_a_chunk_and_the_same_text(tier, chunky_url):
    body = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream_options": {"include_usage": True}}
    runs = {}
    for name, url in (("each", tier.base_url), ("by 4", chunky_url)):
        events = stream_completion(url, body)
        choices = [c for e in events for c in e["choices"]]
        runs[name] = {"tokens": [len(c["logprobs"]["tokens"]) for c in choices],
                      "text": "".join(c["text"] for c in choices),
                      "finish": [c["finish_reason"] for c in choices if c["finish_reason"]],
                      "usage": events[-1]["usage"]}
        del runs[name]["usage"]["prompt_tokens_details"]  # the second finds the first's prefix
    assert runs["each"]["tokens"] == [1] * 10
    apis = [w for w in live_workers(tier.redis_url, tier.prefix) if w["role"] == "api"]
    assert sorted(w["stream_interval"] for w in apis) == [1, 4]  # as `pipeline status` shows
    assert runs["by 4"]["tokens"] == [1, 4, 4, 1]  # the first at once; the finish, the rest
    for key in ("text", "finish", "usage"):
        assert runs["by 4"][key] == runs["each"][key]


def test_stop_strings_under_min_tokens_end_the_text_alike_at_any_interval(tier, chunky_url):
    """A stop string completed before min_tokens does not count; held tokens must
    not let the detokenizer cut at it (a space stops at the first one after 7 tokens)."""
    body = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "stop": [" "],
            "min_tokens": 7}
    each = "".join(c["text"] for e in stream_completion(tier.base_url, body)
                   for c in e["choices"])
    by_4 = "".join(c["text"] for e in stream_completion(chunky_url, body) for c in e["choices"])
    whole = httpx.post(f"{tier.base_url}/v1/completions", json=body,
                       timeout=120).json()["choices"][0]["text"]  # sent when finished
    assert len(each.split(" ")) >= 4, each  # several spaces came before the stop
    assert by_4 == whole == each, (by_4, whole, each)
