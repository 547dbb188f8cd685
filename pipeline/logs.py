# How every process of the tier logs: one line a record on stderr, as text for a
# terminal or as JSON for a log pipeline (Loki, Elasticsearch, CloudWatch), with
# the same fields in both. uvicorn's own records come through here too.

from __future__ import annotations

import json
import logging
import os
from contextvars import ContextVar
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s[%(process)d]%(request)s %(message)s"
# the HTTP request a record was logged for (the api sets it per request: its
# x-request-id), so that its access record and any error say which one
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
# what an api worker process that uvicorn starts (--api-workers) reads to log as
# its parent does
LEVEL_ENV, FORMAT_ENV = "PIPELINE_LOG_LEVEL", "PIPELINE_LOG_FORMAT"


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time (UTC, ISO 8601), level, logger, pid,
    message, the HTTP request's id as `request_id` where it was logged for one,
    and the traceback as `exception` where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line = {"time": when, "level": record.levelname, "logger": record.name,
                "pid": record.process, "message": record.getMessage()}
        if getattr(record, "request_id", None) is not None:
            line["request_id"] = record.request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _tag_request(record: logging.LogRecord) -> bool:
    """The handler's filter: the record's request id, for either format: the one it
    was logged with (`extra={"request_id": ...}`: a scheduler's, for the request it
    is about), else the HTTP request's it was logged for."""
    record.request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
    record.request = "" if record.request_id is None else f" [{record.request_id}]"
    return True


def setup(level: str = "info", fmt: str = "text") -> None:
    """The root logger's one handler; the settings go to the environment too, for
    the api worker processes uvicorn starts (from_env)."""
    if fmt not in FORMATS:
        from pipeline.errors import ConfigError

        raise ConfigError(f"unknown log format {fmt!r}: {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    handler.addFilter(_tag_request)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    os.environ[LEVEL_ENV], os.environ[FORMAT_ENV] = level, fmt


def from_env() -> None:
    """In a process uvicorn started (--api-workers): log as the `pipeline` command
    that started it. Where that command's setup already holds, nothing to do."""
    if not logging.getLogger().handlers:
        setup(os.environ.get(LEVEL_ENV, "info"), os.environ.get(FORMAT_ENV, "text"))
