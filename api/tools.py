# Tool calls a chat must make (tool_choice "required" or a named function), made by
# structured output: the reply is held to the function's parameters schema (or, for
# "required", to {"name", "arguments"} of one of the tools) and returned as a
# tool_calls message. "auto" needs a tool-call parser per model, which we lack.

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from api.protocol import ChatRequest
from pipeline.errors import InvalidRequest
from pipeline.messages import Structure

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalls:
    """How a chat's output becomes its tool call: `name` is the function chosen by
    tool_choice, or None where the output names one of the tools itself."""

    name: str | None

    def structure(self, body: ChatRequest) -> Structure:
        parameters = {tool.function.name: tool.function.parameters or EMPTY_PARAMETERS
                      for tool in body.tools or []}
        if self.name is not None:
            schema = parameters[self.name]
        else:
            schema = {"anyOf": [
                {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for name, params in parameters.items()]}
        return Structure(kind="json_schema", schema=json.dumps(schema))

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The assistant message for the output `text`, and its finish_reason: a cut
        output (length) that names no function stays text."""
        name, arguments = self.name, text
        if name is None:
            try:
                call = json.loads(text)
                name, arguments = call["name"], json.dumps(call["arguments"])
            except (ValueError, KeyError, TypeError):
                return {"role": "assistant", "content": text}, finish
        tool_call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": name, "arguments": arguments}}
        # OpenAI's: a named function's call ends with "stop", a chosen one's "tool_calls"
        if finish == "stop" and self.name is None:
            finish = "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": [tool_call]}, finish


def tool_calls(body: ChatRequest) -> ToolCalls | None:
    """What tools and tool_choice ask; None: an ordinary reply."""
    choice = body.tool_choice
    if choice is None:  # OpenAI's default: auto where there are tools
        choice = "auto" if body.tools else "none"
    if choice == "none" or (choice == "auto" and not body.tools):
        return None
    if not body.tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise InvalidRequest("give tool_choice or response_format, not both", param="tool_choice")
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools' function names must differ", param="tools")
    if choice == "required":
        return ToolCalls(None)
    if choice == "auto":
        raise InvalidRequest('tool_choice "auto" is not supported (no tool-call parser for '
                             'this model): use "required" or name a function',
                             param="tool_choice")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise InvalidRequest('tool_choice must be "none", "required", or '
                             '{"type": "function", "function": {"name": one of the tools}}',
                             param="tool_choice")
    return ToolCalls(name)
