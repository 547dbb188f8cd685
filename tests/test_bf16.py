"""The default dtype on this CPU (bf16) still answers like the model should:
greedy chat output for a factual question matches transformers' fp32 answer.

The question is one whose answer fp32 picks by a clear margin at every token
(2.5 logits or more, 0.97 for the closing period). "What is the capital of
France?" is not: fp32 prefers "The" to "L" by 0.08 logits, so any change of
rounding flips it (oneDNN's bf16 qkv against qgemm's, both exact sums of the
same bf16 numbers, pick the same top token at only 94% of the positions of
bench/quant_accuracy.py's chats)."""

from __future__ import annotations

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.tokenizer import Tokenizer
from workers.scheduler.engine import Engine, EngineRequest


def test_bf16_greedy_says_tokyo_is_the_capital_of_japan(model_files):
    tokenizer = Tokenizer(model_files.path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Japan?"}])
    engine = Engine(model_files.path, SchedulerConfig(dtype="bfloat16"))
    engine.add(EngineRequest("r", tokenizer.encode(prompt), [],
                             Sampling(max_tokens=7, temperature=0.0)))
    out = []
    while engine.has_work():
        for result in engine.step():
            out += result.new_ids
    assert tokenizer.decode(out) == "The capital of Japan is Tokyo."
