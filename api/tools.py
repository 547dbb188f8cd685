# Tool calls. The model is asked for them in its own format (api/tool_reader.py: Llama
# 3's where its template asks for that, else Hermes's), and structured output holds it
# to that format and each function's parameters schema:
# - tool_choice naming a function: the output is that function's arguments alone;
# - "required": one or more calls and nothing else;
# - "auto": text, with calls where the model makes them.
# A chat template that shows tools itself gets them; for one that ignores them, a
# system message describes the tools and Hermes's format.

from __future__ import annotations

import json
from dataclasses import dataclass

from api.protocol import ChatRequest
from api.reasoning import ThoughtReader
from api.tool_reader import HERMES, LLAMA, CallFormat, CallReader, Said
from pipeline.errors import InvalidRequest
from pipeline.messages import Structure
from pipeline.tokenizer import Tokenizer

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalls:
    """What a chat's tools ask of its output. `name`: the function tool_choice names
    (the output is its arguments); else `required`, or "auto"."""

    tools: tuple[tuple[str, str], ...]  # (name, parameters schema as JSON text)
    name: str | None = None
    required: bool = False
    parallel: bool = True
    form: CallFormat = HERMES

    def structure(self) -> Structure:
        if self.name is not None:
            return Structure(kind="json_schema", schema=dict(self.tools)[self.name],
                             field="tools")
        tags = [{"type": "tag", "begin": self.form.begin(name),
                 "content": {"type": "json_schema", "json_schema": json.loads(parameters)},
                 "end": "}" + self.form.closing} for name, parameters in self.tools]
        stop_after_first = not self.parallel
        if self.required:  # calls and nothing else
            form = {"type": "tags_with_separator", "tags": tags,
                    "separator": self.form.separator, "at_least_one": True,
                    "stop_after_first": stop_after_first}
        else:
            form = {"type": "triggered_tags", "triggers": [self.form.trigger], "tags": tags,
                    "stop_after_first": stop_after_first}
        return Structure(kind="structural_tag",
                         schema=json.dumps({"type": "structural_tag", "format": form}),
                         field="tools")

    def reader(self) -> CallReader:
        return CallReader(self.form, self.name)

    def finish_reason(self, calls: list[dict], finish: str | None) -> str | None:
        # OpenAI's: a named function's call ends with "stop", a chosen one's "tool_calls"
        if finish == "stop" and self.name is None and calls:
            return "tool_calls"
        return finish

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The assistant message for a whole output `text`, and its finish_reason."""
        reader = OutputReader(self, None)
        reader.read(text, last=True)
        return reader.message(), reader.finish_reason(finish)


class OutputReader:
    """A chat choice's output as it streams, or whole: a reasoning model's thought
    (api/reasoning.py, where `reasoning` says how it starts), then the content, and
    the tool calls where `calls` asks for them. Each read gives (thought, Said)."""

    def __init__(self, calls: ToolCalls | None, reasoning: str | None):
        self._tools = calls
        self._thoughts = None if reasoning is None else ThoughtReader(reasoning)
        self._calls = None if calls is None else calls.reader()
        self.thought = self.content = ""

    def read(self, text: str, last: bool = False) -> tuple[str, Said]:
        thought = ""
        if self._thoughts is not None:
            thought, text = self._thoughts.read(text, last)
        said = Said(content=text) if self._calls is None else self._calls.read(text, last)
        self.thought += thought
        self.content += said.content
        return thought, said

    @property
    def calls(self) -> list[dict]:
        """The calls read so far, whole, in the message's shape."""
        return [] if self._calls is None else self._calls.calls

    def finish_reason(self, finish: str | None) -> str | None:
        return finish if self._tools is None else self._tools.finish_reason(self.calls, finish)

    def message(self) -> dict:
        """The assistant message of what was read (whole, once the last piece is)."""
        message = {"role": "assistant", "content": self.content}
        if self.calls:
            message = {"role": "assistant", "content": self.content or None,
                       "tool_calls": self.calls}
        if self._thoughts is not None:
            message["reasoning_content"] = self.thought or None
        return message


def tool_calls(body: ChatRequest, tokenizer: Tokenizer) -> ToolCalls | None:
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
    tools = tuple((tool.function.name, json.dumps(tool.function.parameters or EMPTY_PARAMETERS))
                  for tool in body.tools)
    parallel, form = body.parallel_tool_calls, call_format(tokenizer)
    if choice in ("auto", "required"):
        # "required" holds any model to a format; "auto" needs one that knows it
        if choice == "auto" and form is None:
            raise InvalidRequest('tool_choice "auto" is not supported for this model: its chat '
                                 "template asks for tool calls in a format this server does "
                                 'not read; use "required" or name a function',
                                 param="tool_choice")
        return ToolCalls(tools, required=choice == "required", parallel=parallel,
                         form=form or HERMES)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise InvalidRequest('tool_choice must be "none", "auto", "required", or '
                             '{"type": "function", "function": {"name": one of the tools}}',
                             param="tool_choice")
    return ToolCalls(tools, name=name, parallel=parallel, form=form or HERMES)


def call_format(tokenizer: Tokenizer) -> CallFormat | None:
    """The tool-call format the model's template asks for: Hermes's where it says so or
    shows no tools (we ask for it then), Llama 3's where it asks for "parameters";
    None for another."""
    template = tokenizer.chat_template or ""
    if HERMES.trigger in template or not shows_tools(tokenizer):
        return HERMES
    return LLAMA if '"parameters"' in template else None


def shows_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders the tools it is given."""
    return "tools" in (tokenizer.chat_template or "")


def tools_message(tools: list[dict]) -> str:
    """A system message's text that tells a model whose template ignores tools what
    they are and how to call them."""
    lines = "\n".join(json.dumps(tool) for tool in tools)
    return ("# Tools\n\nYou may call one or more of these functions to answer the user. "
            f"Their signatures, one a line, in <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
            "To call one, reply with its name and arguments as JSON in <tool_call></tool_call>:"
            f'\n{HERMES.opening}{{"name": <function name>, "arguments": <arguments object>}}'
            f"{HERMES.closing}")
