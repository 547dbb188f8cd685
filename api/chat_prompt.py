# A chat's messages as the model's prompt: OpenAI's message shapes (text parts, tool
# calls and tool results) turned into what the model's chat template renders, then
# tokenized. A template that knows tool calls gets them as transformers passes them;
# for one that does not, they are written out in the format the model is asked for.

from __future__ import annotations

import json

from api.protocol import ChatMessage, ContentPart
from api.tool_reader import HERMES
from api.tools import shows_tools, tools_message
from pipeline.errors import InvalidRequest
from pipeline.tokenizer import Tokenizer


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer,
                    add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """The chat template's text for these messages and the `tools` offered, tokenized.
    `template_kwargs`: more variables for the template (chat_template_kwargs)."""
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    native = "tool_calls" in (tokenizer.chat_template or "")
    rendered: list[dict] = []
    after_result = False
    for index, message in enumerate(messages):
        item = _template_message(message, index, native)
        is_result = message.role == "tool" and not native
        if is_result and after_result:  # the results of one turn's calls: one message
            joined = f"{rendered[-1]['content']}\n{item['content']}"
            rendered[-1] = rendered[-1] | {"content": joined}
        else:
            rendered.append(item)
        after_result = is_result
    if tools and not shows_tools(tokenizer):
        rendered = _with_system_text(rendered, tools_message(tools))
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt,
                                         tools if tools and shows_tools(tokenizer) else None,
                                         template_kwargs)
    return tokenizer.encode(text)


def _template_message(message: ChatMessage, index: int, native: bool) -> dict:
    param = f"messages[{index}]"
    content = _content_text(message, param)
    if message.role == "tool":
        if message.tool_call_id is None:
            raise InvalidRequest("a tool message needs the tool_call_id it answers",
                                 param=f"{param}.tool_call_id")
        if native:
            return {"role": "tool", "content": content, "tool_call_id": message.tool_call_id}
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    role = "system" if message.role == "developer" else message.role  # OpenAI's newer name
    item = {"role": role, "content": content} | ({"name": message.name} if message.name else {})
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest("only an assistant message makes tool calls",
                                 param=f"{param}.tool_calls")
        calls = [(call.function.name, _arguments(call.function.arguments,
                                                 f"{param}.tool_calls[{j}].function.arguments"))
                 for j, call in enumerate(message.tool_calls)]
        if native:
            item["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for call, (name, arguments) in zip(message.tool_calls, calls, strict=True)]
        else:
            written = "\n".join(
                HERMES.opening + json.dumps({"name": name, "arguments": arguments}) + HERMES.closing
                for name, arguments in calls)
            item["content"] = f"{content}\n{written}" if content else written
    return item


def _content_text(message: ChatMessage, param: str) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant" and message.tool_calls:
            return ""
        raise InvalidRequest("a message needs its content", param=f"{param}.content")
    if isinstance(content, str):
        return content
    # parts are joined by newlines, as vLLM does for text-only models
    return "\n".join(_part_text(part, f"{param}.content[{j}]") for j, part in enumerate(content))


def _part_text(part: ContentPart, param: str) -> str:
    if part.type != "text":
        raise InvalidRequest(f"content parts of type {part.type!r} are not supported: "
                             "this model reads text", param=f"{param}.type")
    if part.text is None:
        raise InvalidRequest("a text part needs its text", param=f"{param}.text")
    return part.text


def _arguments(text: str, param: str) -> dict:
    try:
        arguments = json.loads(text)
    except ValueError:
        raise InvalidRequest("a tool call's arguments must be JSON text", param=param) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest("a tool call's arguments must be a JSON object", param=param)
    return arguments


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`text` at the end of the first system message, or as one of its own first."""
    if messages and messages[0]["role"] == "system":
        first = messages[0] | {"content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
