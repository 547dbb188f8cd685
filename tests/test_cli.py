"""The `pipeline` command as an operator runs it: `status` against the session's
real tier, and bad settings refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.status import live_workers


def pipeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args],
                          capture_output=True, text=True, timeout=60)


def status(*args: str) -> subprocess.CompletedProcess:
    return pipeline("status", *args)


def test_status_shows_every_live_worker_by_role_and_the_queue(tier):
    ids = {w["role"]: w["id"] for w in live_workers(tier.redis_url, tier.prefix)}
    shown = status("--redis-url", tier.redis_url, "--prefix", tier.prefix)
    assert shown.returncode == 0, shown.stderr
    assert f"tier {tier.prefix!r}:" in shown.stdout and "requests queued" in shown.stdout
    assert "no live" not in shown.stdout
    for role, worker_id in ids.items():
        assert role in shown.stdout and worker_id in shown.stdout
    assert "engines and caches" in shown.stdout  # the scheduler's kernels

    found = json.loads(status("--redis-url", tier.redis_url, "--prefix", tier.prefix,
                              "--json").stdout)
    assert found["prefix"] == tier.prefix and found["queued_requests"] == 0
    assert {w["role"]: w["id"] for w in found["workers"]} == ids
    [scheduler] = [w for w in found["workers"] if w["role"] == "scheduler"]
    assert scheduler["num_blocks"] > 0 and "4bit_matmul" in scheduler


def test_status_says_which_roles_are_missing_and_when_redis_is_unreachable(tier):
    empty = status("--redis-url", tier.redis_url, "--prefix", "status-no-such-tier")
    assert empty.returncode == 0
    assert "0 requests queued" in empty.stdout
    for role in ("api", "scheduler", "detokenizer"):
        assert f"no live {role}" in empty.stdout
    down = status("--redis-url", "redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "cannot reach Redis" in down.stdout


def test_bad_settings_are_one_line_and_exit_2_not_a_traceback(tmp_path):
    for args, words in [
        (("serve", "--model", str(tmp_path / "nowhere")), "unknown model"),
        (("worker", "--role", "scheduler", "--model", str(tmp_path)), "no config.json"),
        (("worker", "--role", "api", "--api-workers", "2", "--id", "x"), "--id names one"),
        (("worker", "--role", "api", "--served-model-name", " , "), "needs a name"),
    ]:
        refused = pipeline(*args)
        assert refused.returncode == 2, (args, refused.stderr)
        assert refused.stderr.startswith("error: ") and words in refused.stderr
        assert "Traceback" not in refused.stderr + refused.stdout
