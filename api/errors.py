# Every failure the api reports, as an OpenAI-style body {"error": {message, type, param,
# code}}: PipelineErrors, bad bodies, unknown routes, and bugs (500) alike, before or mid-stream.

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import CODES, InvalidRequest, PipelineError, error_from_code

log = logging.getLogger("pipeline.api")

# Starlette's own errors (routing, body parsing) by status; 405 has no PipelineError
_HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 404: "not_found",
               413: "payload_too_large"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def error_body(error: PipelineError) -> dict:
    return {"error": {"message": error.detail, "type": CODES[error.code][1],
                      "param": error.param, "code": error.code}}


def error_response(error: PipelineError) -> JSONResponse:
    # overload is the one error a client should simply retry
    headers = {"Retry-After": "1"} if error.code == "overloaded" else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def as_pipeline_error(error: BaseException) -> PipelineError:
    """A PipelineError as is; anything else is a bug, logged and reported as internal."""
    if isinstance(error, PipelineError):
        return error
    log.error("unexpected error", exc_info=error)
    return PipelineError(f"internal error: {type(error).__name__}")


def sse_error(error: BaseException) -> bytes:
    """The last event of a stream that fails after its 200 was sent."""
    return b"data: " + msgspec.json.encode(error_body(as_pipeline_error(error))) + b"\n\n"


def validation_error(error: RequestValidationError) -> PipelineError:
    """The first problem, naming the field the way a client wrote it (messages[0].role)."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return InvalidRequest(f"the body is not valid JSON: {reason}")
    if first["type"] == "model_attributes_type" and len(first["loc"]) == 1:
        return InvalidRequest("the body must be a JSON object (Content-Type: application/json)")
    path = [part for part in first["loc"][1:] if not _is_type_tag(part)]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)
    param = param.lstrip(".") or None
    if first["type"] == "missing":
        return InvalidRequest(f"{param or 'the request body'} is required", param=param)
    return InvalidRequest(f"{param or 'body'}: {first['msg']}", param=param)


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(PipelineError, _on_pipeline_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_bug)


async def _on_pipeline_error(_request: Request, error: PipelineError) -> JSONResponse:
    return error_response(error)


async def _on_validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(error))


async def _on_http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_CODES.get(error.status_code)
    if code is None:  # 405 and friends: same body shape, code named after the status
        body = {"error": {"message": str(error.detail), "type": "invalid_request_error",
                          "param": None, "code": _snake(str(error.detail))}}
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)
    body = error_body(error_from_code(code, str(error.detail)))
    return JSONResponse(body, status_code=error.status_code,
                        headers=error.headers)


async def _on_bug(request: Request, error: Exception) -> JSONResponse:
    log.error("500 on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(PipelineError("internal error; this is a bug in the server"))


def _is_type_tag(part) -> bool:
    # pydantic names the union member that failed ("str", "list[int]"); clients never wrote it
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def _snake(text: str) -> str:
    return "_".join(text.lower().split())
