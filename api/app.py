# The api role's HTTP app: FastAPI with the OpenAI and native routes, one Frontend per
# process (started and stopped by the lifespan), the API key and body-size guard. Torch-free.

from __future__ import annotations

import os
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api import native_routes, openai_routes, responses_api, responses_stored, tokenize_routes
from api.errors import error_response, install_handlers
from api.frontend import Frontend
from api.keys import KEY_ID, TIER_LIMIT, ApiKeys
from api.metrics import Metrics
from api.sampling import Limits
from api.served import Served, context_len
from pipeline import logs
from pipeline.config import ApiConfig, Config
from pipeline.config_io import config_from_json
from pipeline.errors import ConfigError, PipelineError, error_from_code
from pipeline.model_identity import identify
from pipeline.models import ModelFiles, resolve_model
from pipeline.tokenizer import Tokenizer

CONFIG_ENV = "PIPELINE_CONFIG_JSON"
OPEN_PATHS = frozenset({"/health"})  # load balancers probe without the key
REQUEST_ID_PATTERN = re.compile(rb"[\x21-\x7e]{1,128}")


def create_app(config: Config, model: ModelFiles | None = None) -> FastAPI:
    model = model or resolve_model(config.model)
    # the id is drawn here, not in Frontend, so that every response can name it
    frontend_id = config.api.frontend_id or uuid.uuid4().hex[:12]
    config = replace(config, api=replace(config.api, frontend_id=frontend_id))
    metrics = Metrics(config.api.metrics_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = Tokenizer(model.path)
        limits = Limits(context_len(model.path), tokenizer.vocab_size, config.api.max_n)
        frontend = Frontend(config.redis, config.api, metrics, identify(model, tokenizer))
        await frontend.start()
        names = config.api.served_model_names or (model.name,)
        app.state.served = Served(names, limits, tokenizer, frontend, config.api)
        try:
            yield
        finally:  # background responses go on while the api drains, then stop
            await app.state.served.background.stop(config.drain_timeout_s)
            await frontend.stop()

    # strict_content_type off: a body sent without a Content-Type is still read as JSON
    app = FastAPI(title="redis-pipeline", lifespan=lifespan, strict_content_type=False)
    install_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_api.router)
    app.include_router(responses_stored.router)
    app.include_router(native_routes.router)
    app.include_router(tokenize_routes.router)
    # the keys parsed here: a bad --api-key fails the start, not the first request
    app.add_middleware(RequestGuard, config=config.api, metrics=metrics,
                       keys=ApiKeys(config.api.api_key))
    if config.api.allowed_origins:  # outside the guard: a browser's preflight has no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.api.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["x-request-id"])
    return app


def app_from_env() -> FastAPI:
    """For `uvicorn.run("api.app:app_from_env", factory=True, workers=N)`: the parent
    passes its Config as JSON in PIPELINE_CONFIG_JSON. With frontend_id None (the
    default), each worker process draws its own id and so owns its own reply stream."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        raise ConfigError(f"{CONFIG_ENV} is not set; start the api with `pipeline serve`")
    logs.from_env()
    return create_app(config_from_json(text))


class RequestGuard:
    """Checks the API key, then reads the body up to max_body_bytes, before any route
    runs: a refused request costs no parsing, and a huge one is never held whole.
    Every response names the frontend that served it (x-pipeline-frontend) and its
    request (x-request-id: the client's own, as a gateway sets it, or a fresh one;
    the same id tags what the api logs for it), and is counted and timed (/metrics)
    by its status once its last byte is sent."""

    def __init__(self, app: ASGIApp, config: ApiConfig, metrics: Metrics, keys: ApiKeys):
        self.app = app
        self.config = config
        self.metrics = metrics
        self.header = (b"x-pipeline-frontend", (config.frontend_id or "").encode())
        self.keys = keys  # any of them, each with its tier limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [None]
        request_id = _request_id(scope)
        # not reset afterwards: the server runs each request in a task of its own, whose
        # context dies with it, and a 500's record is logged outside this call
        logs.REQUEST_ID.set(request_id)
        try:
            await self._guarded(scope, receive, self._tagged(send, status, request_id))
        except Exception:
            status[0] = status[0] or 500  # Starlette's outermost middleware answers it
            raise
        finally:
            if status[0] is not None:  # None: no response began (the client left)
                self.metrics.http(scope["path"], status[0], time.perf_counter() - start)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self._check_key(scope)
            body = await self._read_body(scope, receive)
        except PipelineError as error:
            await error_response(error)(scope, receive, send)
            return
        if body is not None:  # None: the client left while sending
            await self.app(scope, _replay(body, receive), send)

    def _tagged(self, send: Send, status: list[int | None], request_id: str) -> Send:
        headers = [self.header, (b"x-request-id", request_id.encode())]

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = message | {"headers": [*message.get("headers", []), *headers]}
            await send(message)

        return tagged

    def _check_key(self, scope: Scope) -> None:
        if not self.keys or scope["path"] in OPEN_PATHS:
            return
        limit, key_id = self.keys.check(dict(scope["headers"]).get(b"authorization", b""))
        TIER_LIMIT.set(limit)
        KEY_ID.set(key_id)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.config.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise self._too_large()
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> PipelineError:
        return error_from_code("payload_too_large",
                               f"the request body is over {self.config.max_body_bytes} bytes")


def _request_id(scope: Scope) -> str:
    """The client's x-request-id where it is 1-128 visible ASCII characters; else ours."""
    given = dict(scope["headers"]).get(b"x-request-id", b"")
    if REQUEST_ID_PATTERN.fullmatch(given):
        return given.decode()
    return uuid.uuid4().hex


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the server's own messages (disconnect)."""
    is_sent = False

    async def replayed() -> dict:
        nonlocal is_sent
        if is_sent:
            return await receive()
        is_sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
