"""`Config` to and from JSON, so a parent process can hand its settings to
children it cannot call directly (uvicorn's `--workers` re-imports the app)."""

from __future__ import annotations

import msgspec

from pipeline.config import Config
from pipeline.errors import ConfigError


def config_to_json(config: Config) -> str:
    """Every section as a nested object, every field present."""
    return msgspec.json.encode(config).decode()


def config_from_json(text: str | bytes) -> Config:
    """Missing fields take their defaults; wrong types are a ConfigError naming the field.
    Unknown fields are ignored, so an older child reads a newer parent's settings."""
    try:
        return msgspec.json.decode(text, type=Config)
    except msgspec.DecodeError as error:
        raise ConfigError(f"bad config JSON: {error}") from error
