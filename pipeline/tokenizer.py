"""A torch-free tokenizer: HF `tokenizer.json` through the `tokenizers`
library, and the model's chat template rendered by jinja2 the way
transformers renders it. The one adapter for untyped tokenizer configs."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pipeline.errors import InvalidRequest


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def _raise(message: str):
    raise InvalidRequest(f"chat template: {message}")


class Tokenizer:
    def __init__(self, model_dir: Path):
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_path = model_dir / "chat_template.jinja"
        self.chat_template = (
            template_path.read_text() if template_path.exists() else config.get("chat_template")
        )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items()
            if added.special
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocab(self) -> dict[str, int]:
        """Every token's id, added tokens too."""
        return self._tok.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def token_bytes_text(self, token_id: int) -> str:
        """A token's own text for logprobs (decoded alone)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            extra: dict | None = None) -> str:
        """`tools` go to a template that shows them (transformers' name); others ignore them.
        `extra`: more variables for the template (a request's chat_template_kwargs, such
        as Qwen3's enable_thinking)."""
        if not self.chat_template:
            raise InvalidRequest("this model has no chat template: use /v1/completions")
        given = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                 "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                 "tools": tools}
        if clash := sorted(set(extra or {}) & set(given)):
            raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(clash)}",
                                 param="chat_template_kwargs")
        try:
            return self._template.render(**(extra or {}), **given)
        # a template's own errors, or its expressions failing on the values given
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as error:
            raise InvalidRequest(f"chat template failed: {error}") from error
