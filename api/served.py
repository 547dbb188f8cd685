# What every route needs from start-up: the served model's name and limits, its
# tokenizer, and this process's Frontend. Built once by the app's lifespan.

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from api.frontend import Frontend
from api.responses_background import Background
from api.sampling import Limits
from pipeline.config import ApiConfig
from pipeline.errors import ConfigError, ModelNotFound
from pipeline.tokenizer import Tokenizer


@dataclass(frozen=True)
class Served:
    model_names: tuple[str, ...]  # what requests may name it; the first is shown
    limits: Limits
    tokenizer: Tokenizer
    frontend: Frontend
    config: ApiConfig
    background: Background = field(default_factory=Background)  # its background responses

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, requested: str | None) -> None:
        """A missing model field means the served one, as with single-model servers."""
        if requested is not None and requested not in self.model_names:
            raise ModelNotFound(
                f"the model {requested!r} does not exist; this server serves "
                f"{' or '.join(map(repr, self.model_names))}",
                param="model",
            )

    def delta_interval(self, stream: bool) -> int:
        """Tokens a delta from the scheduler carries: a streamed response's chunk, or
        (0) the whole output at once for a response the client gets whole."""
        return self.config.stream_interval if stream else 0


async def served(request: Request) -> Served:
    """Async so that FastAPI calls it on the event loop: a plain function
    dependency runs in its thread pool, a thread hop for every request."""
    return request.app.state.served


def context_len(model_dir: Path) -> int:
    """The model's context limit, read from config.json (no transformers import)."""
    config = json.loads((model_dir / "config.json").read_text())
    value = config.get("max_position_embeddings")
    if not isinstance(value, int) or value < 2:
        raise ConfigError(f"{model_dir}/config.json has no usable max_position_embeddings")
    return value
