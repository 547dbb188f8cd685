"""The default dtype on this CPU (bf16) still answers like the model should:
greedy chat output for a factual question matches transformers' fp32 answer."""

from __future__ import annotations

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.tokenizer import Tokenizer
from workers.scheduler.engine import Engine, EngineRequest


def test_bf16_greedy_says_paris_is_the_capital_of_france(model_files):
    tokenizer = Tokenizer(model_files.path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    engine = Engine(model_files.path, SchedulerConfig(dtype="bfloat16"))
    engine.add(EngineRequest("r", tokenizer.encode(prompt), [],
                             Sampling(max_tokens=12, temperature=0.0)))
    out = []
    while engine.has_work():
        for result in engine.step():
            out += result.new_ids
    assert tokenizer.decode(out) == "The capital of France is Paris."
