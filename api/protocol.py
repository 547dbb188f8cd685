# HTTP request bodies (pydantic): the shapes clients send, checked for type only.
# Ranges and meaning are checked in api/sampling.py; the wire (`Sampling`) is a separate contract.

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingFields(BaseModel):
    """Generation parameters every route shares, under their OpenAI names."""

    # strict: "5" is not an int and true is not a number, as in OpenAI's API
    model_config = ConfigDict(strict=True)

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    n: int = 1
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit


# OpenAI's service tiers ("auto": the default tier here); each its lane (pipeline.streams)
ServiceTier = Literal["auto", "default", "flex", "priority"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class OpenAIRequest(SamplingFields):
    """Fields both OpenAI routes take. Features we cannot honour are declared so a
    request that uses them is refused (see `unsupported`) rather than silently ignored."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    service_tier: ServiceTier | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, if any."""
        if self.best_of not in (None, self.n):
            return "best_of"
        return None


class ContentPart(BaseModel):
    """A message's content part. Text is the one type a text model reads; the route
    refuses any other by its name (image_url, input_audio...), not as a shape error."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A call an assistant message made, sent back in a later turn's history."""

    model_config = ConfigDict(strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant's tool calls alone
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # see api/tools.py
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # more variables for the chat template (vLLM's and SGLang's name): Qwen3's
    # {"enable_thinking": false}, for one
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _newer_name_wins(self) -> ChatRequest:
        # OpenAI renamed max_tokens to max_completion_tokens; accept both
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()


class NativeSampling(SamplingFields):
    """SGLang's `sampling_params`: its names, and nothing we would silently ignore."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_tokens: int | None = Field(None, alias="max_new_tokens")
    min_tokens: int = Field(0, alias="min_new_tokens")
    n: Literal[1] = 1
    json_schema: str | None = None  # SGLang's: the output is JSON this schema admits


class GenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    rid: str | None = None  # echoed as meta_info.id; the wire request_id stays ours (unique)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # SGLang's: with return_logprob, the prompt's logprobs from this position on; -1: none
    logprob_start_len: int = -1

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        return _exactly_one(self, "text", "input_ids")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    tools: list[Tool] | None = None  # messages: the tools offered, as a chat shows them
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        return _exactly_one(self, "prompt", "messages")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


class ResponsesRequest(SamplingFields):
    """OpenAI's Responses API (/v1/responses): `input`, after the stored conversation
    that `previous_response_id` names (api/responses_store.py), becomes a chat
    (api/responses_input.py). Fields for features we lack are declared so that
    `unsupported` can refuse them."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None  # flat: {"type": "function", "name", ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" ...}}
    store: bool | None = None  # None: stored, as OpenAI's default (unless --response-ttl-s 0)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: ServiceTier | None = None

    @model_validator(mode="after")
    def _output_tokens(self) -> ResponsesRequest:
        if self.max_output_tokens is not None:
            self.max_tokens = self.max_output_tokens
        return self

    def unsupported(self) -> str | None:
        lacking = ("conversation", "reasoning", "include", "top_logprobs")
        return next((name for name in lacking if getattr(self, name)), None)


def _exactly_one(body: BaseModel, first: str, second: str):
    """`body`, where exactly one of the two fields is given."""
    if (getattr(body, first) is None) == (getattr(body, second) is None):
        raise ValueError(f"give exactly one of {first} or {second}")
    return body
