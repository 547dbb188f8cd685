"""One error family. Each code maps to one HTTP status and OpenAI error type;
the same codes travel inside `Failed` messages across Redis."""

from __future__ import annotations

RETRY = "retry"  # not an error: "resubmit this as a continuation" (its scheduler died)

# code -> (HTTP status, OpenAI error type)
CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "payload_too_large": (413, "invalid_request_error"),
    "overloaded": (503, "server_overloaded"),
    # a scheduler of another model took the request: the tier is misconfigured (status)
    "model_mismatch": (503, "server_error"),
    "timeout": (408, "timeout"),
    "cancelled": (499, "cancelled"),
    "internal": (500, "internal_error"),
}


class PipelineError(Exception):
    code = "internal"

    def __init__(self, detail: str, *, param: str | None = None):
        super().__init__(detail)
        self.detail = detail
        self.param = param

    @property
    def status(self) -> int:
        return CODES[self.code][0]


class InvalidRequest(PipelineError):
    code = "invalid_request"


class ContextLengthExceeded(PipelineError):
    code = "context_length_exceeded"


class Unauthorized(PipelineError):
    code = "unauthorized"


class ModelNotFound(PipelineError):
    code = "model_not_found"


class NotFound(PipelineError):
    code = "not_found"


class Overloaded(PipelineError):
    code = "overloaded"


class RequestTimeout(PipelineError):
    code = "timeout"


class ModelMismatch(PipelineError):
    code = "model_mismatch"


class ConfigError(PipelineError):
    """Bad start-up settings: reported by the CLI, never over HTTP."""

    code = "invalid_request"


def error_from_code(code: str, detail: str, param: str | None = None) -> PipelineError:
    for cls in (InvalidRequest, ContextLengthExceeded, Unauthorized, ModelNotFound,
                NotFound, Overloaded, RequestTimeout, ModelMismatch):
        if cls.code == code:
            return cls(detail, param=param)
    error = PipelineError(detail, param=param)
    error.code = code if code in CODES else "internal"
    return error
