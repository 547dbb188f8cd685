"""Shared fixtures: the machine's real Redis, the real model, real tiers."""

from __future__ import annotations

import uuid

import pytest
import redis

from pipeline.models import resolve_model
from tests.harness import Tier, delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError:
        pytest.fail(f"tests need a Redis at {REDIS_URL} (.ci/run starts one)")
    return REDIS_URL


@pytest.fixture
def prefix(redis_url):
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    delete_prefix(redis_url, name)


@pytest.fixture(scope="session")
def model_files():
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def tier(redis_url, model_files, tmp_path_factory):
    """One api, one scheduler (fp32, so greedy output matches transformers), one detokenizer."""
    tier = Tier(redis_url, f"test-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("tier"))
    tier.start("scheduler")
    tier.start("detokenizer")
    tier.base_url = tier.start_api()
    try:
        tier.wait_ready()
        yield tier
    finally:
        tier.stop()
