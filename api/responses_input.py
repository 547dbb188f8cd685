# A Responses API request as the chat it amounts to: `instructions`, the stored items it
# continues (previous_response_id) and `input`'s items (messages, function calls and their
# outputs; reasoning items are dropped) become chat messages, flat function tools
# become chat tools, `text.format` becomes response_format. Its errors name the
# Responses field (input[2].content[0].type), not the chat's.

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from api.protocol import ChatRequest, ResponsesRequest, SamplingFields
from pipeline.errors import InvalidRequest, PipelineError

TEXT_PARTS = ("input_text", "output_text", "text")
# a chat's field -> the Responses field an error names
CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens",
                     "response_format.json_schema": "text.format",  # flattened there
                     "response_format": "text.format"}


def input_items(body: ResponsesRequest) -> list[dict]:
    """`input` as items: a text is one user message."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return body.input


def to_chat(body: ResponsesRequest, history: list[dict] = ()) -> ChatRequest:
    """`history`: the stored items that `previous_response_id` continues (its
    instructions are not carried over, as with OpenAI)."""
    field = body.unsupported()
    if field is not None:
        raise InvalidRequest(f"{field} is not supported by this server", param=field)
    if body.n != 1:
        raise InvalidRequest("the Responses API makes one output", param="n")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    for item in history:
        _add_item(messages, item, "previous_response_id")
    for index, item in enumerate(input_items(body)):
        _add_item(messages, item, f"input[{index}]")
    sampling = body.model_dump(include=set(SamplingFields.model_fields))
    chat = {**sampling, "model": body.model, "stream": body.stream, "messages": messages,
            "tools": [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools or [])]
            or None, "tool_choice": _chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body.text), "service_tier": body.service_tier}
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as error:  # a message of the wrong shape: name its item
        where = error.errors()[0]["loc"]
        param = f"input[{where[1]}]" if where[:1] == ("messages",) and len(where) > 1 \
            else "input"
        raise InvalidRequest(f"input: {error.errors()[0]['msg']}", param=param) from None


def responses_param(error: PipelineError) -> PipelineError:
    """`error` naming the Responses field where a chat's check named its own."""
    param = error.param or ""
    if param == "messages" or param.startswith("messages["):
        error.param = "input"  # instructions and merged calls shift the chat's numbering
    for chat, ours in CHAT_TO_RESPONSES.items():
        if param == chat or param.startswith(chat + "."):
            error.param = ours + param[len(chat):]
            if chat == "response_format.json_schema":
                error.param = ours
            break
    for chat, ours in (("response_format", "text.format"), ("max_tokens", "max_output_tokens")):
        error.detail = error.detail.replace(chat, ours)
    return error


def _add_item(messages: list[dict], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequest("a message's role must be user, system, developer or "
                                 "assistant", param=f"{param}.role")
        messages.append({"role": role, "content": _text(item.get("content"), param)})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", param), "type": "function", "function": {
            "name": _string(item, "name", param),
            "arguments": _string(item, "arguments", param)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # one turn's calls: one message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "reasoning":  # a past thought: chat templates keep none
        return
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                         "content": output if isinstance(output, str)
                         else _text(output, param, "output")})
    else:
        raise InvalidRequest(f"input items of type {kind!r} are not supported: this server "
                             "takes messages, function_call, function_call_output and "
                             "reasoning",
                             param=f"{param}.type")


def _text(content: Any, param: str, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{field} must be text or a list of text parts",
                             param=f"{param}.{field}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"content parts of type {kind!r} are not supported: this "
                                 "model reads text", param=f"{param}.{field}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{key} must be a string", param=f"{param}.{key}")
    return value


def _chat_tool(tool: dict, param: str) -> dict:
    if tool.get("type") != "function":
        raise InvalidRequest(f"tools of type {tool.get('type')!r} are not supported: this "
                             "server runs function tools", param=f"{param}.type")
    spec = {key: tool[key] for key in ("name", "description", "parameters", "strict")
            if tool.get(key) is not None}
    return {"type": "function", "function": spec}


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    form = (text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return form
    spec = {key: form[key] for key in ("name", "schema", "strict") if key in form}
    return {"type": "json_schema", "json_schema": spec}
