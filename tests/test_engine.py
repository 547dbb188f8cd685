"""The engine on the real model (fp32 so greedy output can equal transformers'):
continuous batching, chunked prefill, preemption, prefix reuse, abort, seeds."""

from __future__ import annotations

import json
import os
import time

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.reasoning import ThoughtReader, think_first
from pipeline.config import SchedulerConfig
from pipeline.errors import ContextLengthExceeded, InvalidRequest
from pipeline.messages import Sampling, Structure
from workers.scheduler.engine import Engine, EngineRequest

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three colors.",
    "Give me a short tip for learning to cook pasta well at home.",
    "Hi",
]
NUM_NEW = 12
GREEDY = Sampling(max_tokens=NUM_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer(model_files):
    return AutoTokenizer.from_pretrained(model_files.path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                          add_generation_prompt=True, tokenize=True)["input_ids"]
            for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model(model_files):
    return AutoModelForCausalLM.from_pretrained(model_files.path, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone."""
    model = hf_model
    outputs = []
    for ids in prompt_ids:
        out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def make_engine(model_files, **overrides) -> Engine:
    return Engine(model_files.path, SchedulerConfig(dtype="float32", **overrides))


@pytest.fixture(scope="module")
def engine(model_files) -> Engine:
    return make_engine(model_files)


def run_all(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    for request in requests:
        engine.add(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: set[str] = set()
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id] += result.new_ids
            if result.finish is not None:
                finished.add(result.request_id)
    assert finished == set(outputs)
    return outputs


def greedy_requests(prompt_ids, sampling: Sampling = GREEDY) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", ids, [], sampling) for i, ids in enumerate(prompt_ids)]


def test_greedy_output_equals_transformers_generate(engine, prompt_ids, reference):
    outputs = run_all(engine, greedy_requests(prompt_ids))
    for i, expected in enumerate(reference):
        # both stop after EOS and include it
        assert outputs[f"r{i}"] == expected
    assert engine.stats().num_running == 0


def test_abort_frees_kv_blocks(engine, prompt_ids):
    free_before = engine.stats().num_free_blocks
    engine.add(EngineRequest("doomed", prompt_ids[0], [], GREEDY))
    engine.step()
    assert engine.stats().num_free_blocks < free_before
    assert engine.abort("doomed")
    assert engine.stats().num_free_blocks == free_before
    assert not engine.has_work()
    assert not engine.abort("doomed")


def test_prompt_that_cannot_fit_the_context_is_refused(engine):
    too_long = Sampling(max_tokens=engine.max_context)
    with pytest.raises(ContextLengthExceeded):
        engine.add(EngineRequest("big", [1, 2, 3], [], too_long))


def test_a_token_id_past_the_models_embeddings_is_refused(engine):
    """The scheduler checks ids against the tokenizer's vocabulary; the engine
    against its own embedding table, which layers.c reads unchecked."""
    vocab = engine.model.embed.shape[0]
    for ids in ([1, vocab], [-1, 2]):
        with pytest.raises(InvalidRequest, match="token ids"):
            engine.add(EngineRequest("bad", ids, [], Sampling(max_tokens=2)))
    assert not engine.has_work()


def test_many_concurrent_requests_of_different_lengths_each_match_running_alone(
        engine, prompt_ids, reference):
    requests = [EngineRequest(f"r{i}", prompt_ids[i % len(prompt_ids)], [],
                              Sampling(max_tokens=1 + i % NUM_NEW, temperature=0.0))
                for i in range(24)]
    outputs = run_all(engine, requests)
    for i, request in enumerate(requests):
        assert outputs[f"r{i}"] == reference[i % len(prompt_ids)][:request.sampling.max_tokens]


def test_chunked_prefill_gives_the_same_output(model_files, prompt_ids, reference):
    engine = make_engine(model_files, max_batch_tokens=16)
    outputs = run_all(engine, greedy_requests(prompt_ids))
    assert [outputs[f"r{i}"] for i in range(len(prompt_ids))] == reference


def test_preemption_under_a_tiny_kv_budget_still_gives_correct_output(
        model_files, prompt_ids, reference):
    engine = make_engine(model_files, kv_cache_mb=5)  # 7 blocks of 16 tokens
    outputs = run_all(engine, greedy_requests(prompt_ids))
    assert engine.stats().num_preemptions > 0
    assert [outputs[f"r{i}"] for i in range(len(prompt_ids))] == reference
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_the_kv_cache_fills_its_budget_and_never_exceeds_it(model_files):
    for budget_mb in (5, 12):
        stats = make_engine(model_files, kv_cache_mb=budget_mb).stats()
        per_block = stats.kv_cache_bytes // stats.num_blocks
        assert stats.kv_budget_bytes == budget_mb * 2**20
        assert stats.kv_budget_bytes - per_block < stats.kv_cache_bytes <= stats.kv_budget_bytes


def test_stats_say_how_fast_the_engine_stepped_lately(model_files, prompt_ids):
    engine = make_engine(model_files)
    idle = engine.stats()
    assert (idle.recent_steps, idle.step_ms_p50, idle.output_tokens_per_s) == (0, None, None)
    for request in greedy_requests(prompt_ids[:3]):
        engine.add(request)
    steps = tokens = 0
    started = time.perf_counter()
    while engine.has_work():
        tokens += sum(len(result.new_ids) for result in engine.step())
        steps += 1
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    assert stats.recent_steps == steps
    assert 3 <= tokens <= 3 * NUM_NEW  # some stop at their EOS
    assert 0 < stats.step_ms_p50 < elapsed * 1000
    # each prompt's tokens once (less any its prefix cache held), then one a decode
    # (the last token sampled is never run)
    run = sum(len(ids) for ids in prompt_ids[:3]) - stats.num_prefix_hit_tokens + tokens - 3
    assert stats.rows_per_step == pytest.approx(run / steps, abs=0.01)
    assert tokens / elapsed - 0.01 <= stats.output_tokens_per_s <= tokens / (steps * 1e-4)
    engine.pace.window_s = 0.0  # every step is older than the window now
    assert engine.stats().recent_steps == 0


def test_a_repeated_prompt_reuses_cached_prefix_blocks(model_files, prompt_ids, reference):
    engine = make_engine(model_files)
    first = run_all(engine, greedy_requests(prompt_ids[:1]))
    assert engine.stats().num_prefix_hit_tokens == 0
    again = run_all(engine, [EngineRequest("again", prompt_ids[0], [], GREEDY)])
    # whole blocks, and where the first run filled the next one, part of it (copied)
    hits = engine.stats().num_prefix_hit_tokens
    assert 16 <= (len(prompt_ids[0]) - 1) // 16 * 16 <= hits <= len(prompt_ids[0]) - 1
    assert again["again"] == first["r0"] == reference[0]


def test_a_burst_of_chats_computes_their_system_prompt_once(model_files, prompt_ids, reference):
    """Chats arriving together: the first computes the template's system prompt
    (24 tokens: a block and 8), the rest wait a step and reuse it, and every
    answer is still transformers' own."""
    engine = make_engine(model_files)
    system = len(os.path.commonprefix(prompt_ids))
    assert system == 24 and len(prompt_ids) >= 3
    outputs = run_all(engine, greedy_requests(prompt_ids))
    assert engine.stats().num_prefix_hit_tokens == (len(prompt_ids) - 1) * system
    assert [outputs[f"r{i}"] for i in range(len(prompt_ids))] == reference


def test_a_prompt_sharing_part_of_a_block_reuses_that_part(model_files, prompt_ids):
    """The copied slots are the KV the prompt's own prefill would have written:
    the answer is the one an engine with nothing cached gives."""
    shared, tail = prompt_ids[0][:21], prompt_ids[1][24:36]  # a block and 5 tokens, then
    assert tail[0] != prompt_ids[0][21]  # another prompt's words (24: past the system prompt)
    prompt = shared + tail
    fresh = run_all(make_engine(model_files), [EngineRequest("fresh", prompt, [], GREEDY)])
    engine = make_engine(model_files)
    run_all(engine, greedy_requests(prompt_ids[:1]))
    hits = engine.stats().num_prefix_hit_tokens
    again = run_all(engine, [EngineRequest("again", prompt, [], GREEDY)])
    assert engine.stats().num_prefix_hit_tokens - hits == 21
    assert again["again"] == fresh["fresh"]


def test_seeded_sampling_is_reproducible_and_resumes_from_delivered_tokens(engine, prompt_ids):
    sampling = Sampling(max_tokens=NUM_NEW, temperature=0.9, top_p=0.95, seed=1234,
                        ignore_eos=True)
    first = run_all(engine, [EngineRequest("a", prompt_ids[1], [], sampling)])["a"]
    second = run_all(engine, [EngineRequest("b", prompt_ids[1], [], sampling)])["b"]
    assert first == second and len(first) == NUM_NEW
    delivered = first[:5]
    resumed = run_all(engine, [EngineRequest("c", prompt_ids[1], delivered, sampling)])["c"]
    assert delivered + resumed == first
    other_seed = Sampling(max_tokens=NUM_NEW, temperature=0.9, top_p=0.95, seed=99,
                          ignore_eos=True)
    assert run_all(engine, [EngineRequest("d", prompt_ids[1], [], other_seed)])["d"] != first


def test_a_continuation_counts_delivered_tokens_toward_max_tokens(engine, prompt_ids, reference):
    delivered = reference[2][:4]
    outputs = run_all(engine, [EngineRequest("c", prompt_ids[2], delivered, GREEDY)])
    assert delivered + outputs["c"] == reference[2]
    spent = run_all(engine, [EngineRequest("d", prompt_ids[2], reference[2], GREEDY)])
    assert spent["d"] == []


def test_min_tokens_holds_back_eos_and_stop_ids_end_with_stop(engine, prompt_ids, reference):
    eos_at = reference[0].index(2)  # the reference answer ends with EOS (id 2)
    held = Sampling(max_tokens=eos_at + 4, temperature=0.0, min_tokens=eos_at + 3)
    outputs = run_all(engine, [EngineRequest("m", prompt_ids[0], [], held)])
    assert len(outputs["m"]) == eos_at + 4 and 2 not in outputs["m"][:eos_at + 3]
    stop_id = reference[1][3]
    stopped = Sampling(max_tokens=NUM_NEW, temperature=0.0, stop_token_ids=[stop_id])
    engine.add(EngineRequest("s", prompt_ids[1], [], stopped))
    results = []
    while engine.has_work():
        results += engine.step()
    assert [t for r in results for t in r.new_ids] == reference[1][:4]
    assert results[-1].finish == "stop"


def test_logprobs_come_with_top_alternatives(engine, prompt_ids, reference):
    sampling = Sampling(max_tokens=3, temperature=0.0, logprobs=2)
    engine.add(EngineRequest("lp", prompt_ids[0], [], sampling))
    results = []
    while engine.has_work():
        results += engine.step()
    for result in results:
        [chosen] = result.logprobs
        assert chosen.token_id == result.new_ids[0]
        assert len(chosen.top) == 2 and chosen.top[0].token_id == chosen.token_id
        assert chosen.logprob == pytest.approx(chosen.top[0].logprob)
        assert chosen.top[0].logprob >= chosen.top[1].logprob


@pytest.mark.parametrize("overrides", [{}, {"max_batch_tokens": 16}],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers_and_come_once(
        model_files, hf_model, prompt_ids, reference, overrides):
    """Each prompt token's logprob under the tokens before it, sent with the first
    output token, whole even where the prompt's blocks are cached already (they
    are computed again) and where its prefill is cut into chunks."""
    engine = make_engine(model_files, **overrides)
    run_all(engine, greedy_requests(prompt_ids[:1]))  # prompt 0's blocks now cached
    sampling = Sampling(max_tokens=NUM_NEW, temperature=0.0, prompt_logprobs=2)
    prompts = prompt_ids[:3]
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(f"p{i}", ids, [], sampling))
    outputs, got = {f"p{i}": [] for i in range(len(prompts))}, {}
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id] += result.new_ids
            if result.prompt_logprobs is not None:
                assert result.request_id not in got and len(outputs[result.request_id]) == 1
                got[result.request_id] = result.prompt_logprobs
    assert [outputs[f"p{i}"] for i in range(len(prompts))] == reference[:3]
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1], -1)
        logprobs = got[f"p{i}"]
        assert [lp.token_id for lp in logprobs] == ids[1:]
        assert [lp.logprob for lp in logprobs] == pytest.approx(
            expected.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist(), abs=1e-3)
        top = expected.topk(2).indices.tolist()
        assert [[t.token_id for t in lp.top] for lp in logprobs] == top


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                          "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_json_schema_holds_the_output_and_a_continuation_resumes_inside_it(
        engine, tokenizer):
    """Greedy output held to a schema parses and fits it; a continuation that was
    delivered the first tokens (a rescue) makes exactly the rest; delivered tokens the
    schema cannot take are refused."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name a famous person."}],
                                        add_generation_prompt=True, tokenize=True)["input_ids"]
    structure = Structure(kind="json_schema", schema=json.dumps(PERSON))
    sampling = Sampling(max_tokens=60, temperature=0.0, structure=structure)
    whole = run_all(engine, [EngineRequest("whole", ids, [], sampling)])["whole"]
    person = json.loads(tokenizer.decode(whole, skip_special_tokens=True))
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    rest = run_all(engine, [EngineRequest("rest", ids, whole[:5], sampling)])["rest"]
    assert whole[:5] + rest == whole
    # with ignore_eos the schema's end still ends it: nothing can follow
    ignoring = run_all(engine, [EngineRequest("ignoring", ids, [], msgspec.structs.replace(
        sampling, ignore_eos=True))])["ignoring"]
    assert ignoring == whole
    # min_tokens cannot hold back the end of what a schema has made whole
    held = run_all(engine, [EngineRequest("held", ids, [], msgspec.structs.replace(
        sampling, min_tokens=len(whole) + 5))])["held"]
    assert held == whole
    wrong = tokenizer.encode("Hello")
    with pytest.raises(InvalidRequest, match="does not follow"):
        engine.add(EngineRequest("wrong", ids, wrong, sampling))
    with pytest.raises(InvalidRequest, match="schema: Unsupported type"):
        engine.add(EngineRequest("bad", ids, [], Sampling(structure=Structure(
            kind="json_schema", schema='{"type": "nonsense"}'))))
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "end": "</call>",
                                                "content": {"type": "json_schema",
                                                            "json_schema": {"type": "nonsense"}}}}
    with pytest.raises(InvalidRequest, match="a tool's parameters") as refused:
        engine.add(EngineRequest("bad tool", ids, [], Sampling(structure=Structure(
            kind="structural_tag", schema=json.dumps(tag)))))
    assert refused.value.param == "tools"


@pytest.mark.parametrize(("start", "delivered", "thought"), [
    ("before", "<think>\nWho is famous? Ada.\n</think>\n\n", "Who is famous? Ada.\n"),
    ("inside", "Ada Lovelace.</think>", "Ada Lovelace."),
    ("before", "", None),
])
def test_a_reasoning_model_thinks_before_its_structured_answer(engine, tokenizer, start,
                                                               delivered, thought):
    """think_first: a thought (here delivered, as a continuation would be) is free text,
    and the answer after it is held to the schema; undelivered, the model may think."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name a famous person."}],
                                        add_generation_prompt=True, tokenize=True)["input_ids"]
    structure = think_first(Structure(kind="json_schema", schema=json.dumps(PERSON)), start)
    assert structure.kind == "structural_tag"
    given = tokenizer.encode(delivered, add_special_tokens=False)
    sampling = Sampling(max_tokens=80, temperature=0.0, structure=structure)
    rest = run_all(engine, [EngineRequest("r", ids, given, sampling)])["r"]
    reader = ThoughtReader(start)
    said, answer = reader.read(tokenizer.decode(given + rest, skip_special_tokens=True),
                               last=True)
    assert thought is None or said == thought
    assert set(json.loads(answer)) == {"name", "age"}


def test_greedy_picks_in_the_lm_heads_kernel_equal_the_samplers(model_files, prompt_ids):
    """A bf16 engine on AMX's tiles or VNNI's int8 kernel picks greedy tokens in
    the lm_head's kernel (linear.Dense.greedy) unless a request asks more of the
    logits: the same tokens as the sampler's argmax, which logprobs send every
    step through."""
    engine = Engine(model_files.path, SchedulerConfig(dtype="bfloat16"))
    head = engine.model.lm_head
    if head.greedy(torch.zeros(16, engine.model.spec.hidden_size)) is None:
        pytest.skip("the lm_head has no fused argmax on this host (AMX's tiles, VNNI)")
    prompts = prompt_ids * 3  # 18 rows a decode step: with AMX the tiles', not int8's
    plain = run_all(engine, greedy_requests(prompts))
    with_logprobs = Sampling(max_tokens=NUM_NEW, temperature=0.0, logprobs=0)
    assert run_all(engine, greedy_requests(prompts, with_logprobs)) == plain


def test_can_admit_counts_slots_by_tier(model_files, prompt_ids):
    """Room by tier (priority, default, flex): default requests take the slots of
    their own tier and flex's, not priority's (priority preempts them)."""
    engine = make_engine(model_files, max_running_requests=2)
    assert engine.can_admit() == [2, 2, 2]
    for i in range(2):
        engine.add(EngineRequest(f"x{i}", prompt_ids[0], [], GREEDY))
    assert engine.can_admit() == [2, 0, 0]
    engine.abort("x0")
    assert engine.can_admit() == [2, 1, 1]
