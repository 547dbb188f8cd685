"""One tier serves one model: a worker started with another `--model` refuses to
join, a Submit tokenized for another model is refused by the scheduler, and
`pipeline status` shows a tier that mixes them (pipeline/model_identity.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from api.frontend import Frontend
from pipeline.config import ApiConfig, Config, RedisConfig
from pipeline.errors import CODES, PipelineError
from pipeline.messages import (
    FIELD,
    ReplyBatch,
    Sampling,
    StepOutput,
    TokenBatch,
    control_decoder,
    replies_decoder,
)
from pipeline.model_identity import ModelIdentity, identify
from pipeline.models import ModelFiles
from pipeline.streams import Keys
from pipeline.tokenizer import Tokenizer
from tests.harness import free_port, worker_env
from workers.detokenizer import Detokenizer


def variant(model: ModelFiles, directory: Path, *, added_token: str | None = None,
            config: dict | None = None) -> ModelFiles:
    """The model's files under another directory, its weights shared; with a token
    added to its tokenizer, or `config` changed."""
    directory.mkdir()
    for source in model.path.iterdir():
        (directory / source.name).symlink_to(source)
    if added_token is not None:
        tokenizer = HFTokenizer.from_file(str(model.path / "tokenizer.json"))
        tokenizer.add_tokens([added_token])
        (directory / "tokenizer.json").unlink()
        tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        changed = json.loads((model.path / "config.json").read_text()) | config
        (directory / "config.json").unlink()
        (directory / "config.json").write_text(json.dumps(changed))
    return ModelFiles(directory.name, directory)


def fingerprint(model: ModelFiles) -> str:
    return identify(model, Tokenizer(model.path)).fingerprint


def test_the_fingerprint_is_the_models_not_its_directorys(model_files, tmp_path):
    own = fingerprint(model_files)
    assert fingerprint(variant(model_files, tmp_path / "elsewhere")) == own
    assert fingerprint(variant(model_files, tmp_path / "more", added_token="<extra>")) != own
    deeper = variant(model_files, tmp_path / "deeper", config={"num_hidden_layers": 31})
    assert fingerprint(deeper) != own


@pytest.mark.parametrize("role", ["detokenizer", "api"])
def test_a_worker_of_another_model_refuses_to_join_the_tier(tier, model_files, tmp_path, role):
    other = variant(model_files, tmp_path / "other-model", added_token="<extra>")
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "worker", "--role", role, "--model",
         str(other.path), "--redis-url", tier.redis_url, "--prefix", tier.prefix,
         *(["--port", str(free_port())] if role == "api" else [])],
        capture_output=True, text=True, timeout=120, env=worker_env())
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert f"serves model '{model_files.name}'" in line and f"this {role} loaded" in line
    assert fingerprint(other) in line


async def test_a_submit_for_another_model_is_refused_and_status_shows_the_mix(tier):
    """An api that started as the tier's schedulers did (no live worker to tell it
    otherwise): its requests are refused, 503 `model_mismatch`, not garbled."""
    stranger = Frontend(RedisConfig(url=tier.redis_url, prefix=tier.prefix), ApiConfig(),
                        identity=ModelIdentity("another-model", "0123456789abcdef"))
    await stranger.start()
    try:
        with pytest.raises(PipelineError) as refused:
            async for _ in stranger.generate([1, 2, 3], Sampling(max_tokens=4), timeout_s=30):
                pass
        assert refused.value.code == "model_mismatch" and CODES["model_mismatch"][0] == 503
        assert "0123456789abcdef" in refused.value.detail
        shown = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "status", "--redis-url", tier.redis_url,
             "--prefix", tier.prefix], capture_output=True, text=True, timeout=60)
        said = " ".join(shown.stdout.split())  # as one line, however rich wrapped it
        assert "the tier mixes models" in said, said
        assert "'another-model' (0123456789abcdef): 1 api, 0 scheduler" in said, said
        metrics = httpx.get(f"{tier.base_url}/metrics", timeout=10).text
        assert "\npipeline_models 2.0\n" in metrics  # what an alert reads
    finally:
        await stranger.stop()


async def test_another_models_tokens_are_failed_and_cancelled_not_decoded(
        redis_url, prefix, model_files):
    """Two workers of different models that joined an empty tier at once: a
    detokenizer fails the requests of a batch from another model's scheduler
    (503 `model_mismatch` at the api) and tells the schedulers to stop them;
    its own model's batch is decoded as ever."""
    config = Config(model=str(model_files.path), redis=RedisConfig(url=redis_url, prefix=prefix,
                                                                   read_block_ms=100))
    tokenizer = Tokenizer(model_files.path)
    own = identify(model_files, tokenizer).fingerprint
    detokenizer = Detokenizer(config, tokenizer, own)
    keys = Keys(prefix)
    reply_to = keys.replies("front")
    client = detokenizer.client
    try:
        await detokenizer.join()
        await client.redis.xadd(reply_to, {"hello": "front"})  # replies go to NOMKSTREAM
        await client.redis.xadd(keys.control, {"hello": "x"})
        hello = tokenizer.encode("Hello")
        for request_id, fingerprint in (("foreign", "0123456789abcdef"), ("own", own)):
            await client.add(keys.tokens, TokenBatch("scheduler-x", [StepOutput(
                request_id, reply_to, 0, hello, [], "length")], [], fingerprint))
        replies: list[ReplyBatch] = []
        for _ in range(10):
            await detokenizer.step()
            entries = await client.redis.xrange(reply_to, "(0-1", "+")
            replies = [replies_decoder.decode(raw[FIELD]) for _, raw in entries
                       if FIELD in raw]
            if sum(len(r.deltas) + len(r.failures) for r in replies) == 2:
                break
        failures = [f for r in replies for f in r.failures]
        deltas = [d for r in replies for d in r.deltas]
        assert [(f.request_id, f.code) for f in failures] == [("foreign", "model_mismatch")]
        assert "0123456789abcdef" in failures[0].detail
        assert [(d.request_id, d.text) for d in deltas] == [("own", "Hello")]
        cancels = [control_decoder.decode(raw[FIELD])
                   for _, raw in await client.redis.xrange(keys.control)
                   if FIELD in raw]
        assert [c.request_ids for c in cancels] == [["foreign"]]
    finally:
        await detokenizer.reader.close()
        await client.close()
