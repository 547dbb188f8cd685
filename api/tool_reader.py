# Reading a chat's output for tool calls as it streams. A call is a JSON object
# {"name": NAME, ARGUMENTS_KEY: {...}} in the model's format (CallFormat): Hermes's
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (Qwen2.5, Qwen3, and the
# format we ask of a model whose template knows no tools), or Llama 3's bare
# {"name": ..., "parameters": ...}. Text outside calls is the message's content. A
# call's arguments go out as they come; where they end is found by their braces.

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CallFormat:
    opening: str  # before a call's object: its tag, or nothing
    arguments: str  # the key its arguments go under
    closing: str  # after its object
    separator: str  # between calls, where the output makes several
    trigger: str  # what in text begins a call

    def begin(self, name: str) -> str:
        """A call's text up to its arguments."""
        return f'{self.opening}{{"name": {json.dumps(name)}, "{self.arguments}": '

    def header(self) -> re.Pattern:
        return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"'
                          + self.arguments + r'"\s*:\s*(?=\S)')


HERMES = CallFormat("<tool_call>\n", "arguments", "\n</tool_call>", "\n", "<tool_call>")
LLAMA = CallFormat("", "parameters", "", "; ", '{"name"')
MAX_HEADER = 256  # a call's start past which no name has come: text after all


@dataclass
class Said:
    """What one read adds to the message: content, and tool-call pieces in OpenAI's
    streamed shape (the first piece of a call carries its id and name)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def call_piece(self, index: int, arguments: str, opening: dict | None = None) -> None:
        if self.calls and self.calls[-1]["index"] == index:  # one piece a call a delta
            self.calls[-1]["function"]["arguments"] += arguments
        elif opening is not None:
            self.calls.append({"index": index, "id": opening["id"], "type": "function",
                               "function": {"name": opening["name"], "arguments": arguments}})
        elif arguments:
            self.calls.append({"index": index, "function": {"arguments": arguments}})

    def delta(self) -> dict:
        out = {"content": self.content} if self.content else {}
        return out | ({"tool_calls": self.calls} if self.calls else {})


class CallReader:
    """One choice's output, read piece by piece. `name`: the output is that function's
    arguments alone (tool_choice naming it)."""

    def __init__(self, form: CallFormat = HERMES, name: str | None = None):
        self.form, self.bare, self._header = form, name is not None, form.header()
        self.calls: list[dict] = []  # whole, in the message's shape
        self.content = ""
        self._state = "text"
        self._pending = ""  # read, not yet given out
        self._space = ""  # content's trailing whitespace, held: it may only lead to a call
        self._depth, self._in_string, self._escaped = 0, False, False  # the arguments' JSON
        self._unsaid = Said()  # a named call's opening, said with the first read
        if name is not None:
            self._start(name, self._unsaid)

    def read(self, text: str, last: bool = False) -> Said:
        """What `text` adds; `last`: the output ends with it, so nothing is held back."""
        said, self._unsaid = self._unsaid, Said()
        self._pending += text
        while self._step(said, last):
            pass
        if last:
            if not self.calls:
                said.content += self._space
                self.content += self._space
            self._pending = self._space = ""
        return said

    def _step(self, said: Said, last: bool) -> bool:
        """One move of the reading; False once it waits for more text."""
        if self._state == "text":
            at = self._pending.find(self.form.trigger)
            if at < 0:
                keep = 0 if last else partial_tail(self._pending, self.form.trigger)
                self._say(said, self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return False
            self._say(said, self._pending[:at])
            skip = len(self.form.trigger) if self.form.opening else 0  # a bare object stays
            self._pending, self._state, self._space = self._pending[at + skip:], "header", ""
            return True
        if self._state == "header":
            match = self._header.match(self._pending)
            name = _name(match)
            if name is None:
                if len(self._pending) <= MAX_HEADER and not last:
                    return False  # the name may yet come
                self._say(said, self.form.trigger if self.form.opening else "")
                self._state = "text"  # no call after all: text, the trigger's own included
                self._say(said, self._pending[:1])
                self._pending = self._pending[1:]
                return True
            self._start(name, said)
            self._pending = self._pending[match.end():]
            return True
        if self._state == "arguments":
            return self._arguments(said)
        return self._close(last)

    def _arguments(self, said: Said) -> bool:
        """Give out the arguments read so far, up to where their object closes."""
        end = len(self._pending)
        for at, char in enumerate(self._pending):
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0 and not self.bare:
                    end = at + 1
                    self._state = "closing"
                    break
        self._give(said, self._pending[:end])
        self._pending = self._pending[end:]
        return self._state == "closing"

    def _close(self, last: bool) -> bool:
        """Past a call's object and its closing tag; text again after them."""
        rest = self._pending.lstrip()
        if not rest.startswith("}"):  # the object's end not yet read (or never written)
            if not rest and not last:
                return False
            self._pending, self._state = rest, "text"
            return True
        after, closing = rest[1:].lstrip(), self.form.closing.strip()
        if closing and after.startswith(closing):
            after = after[len(closing):]
        elif closing and closing.startswith(after):  # the tag may be on its way
            if not last:
                return False
            after = ""
        separator, head = self.form.separator.strip(), after.lstrip()
        if separator and head.startswith(separator):  # Llama's "; " before another call
            after = head[len(separator):]
        elif separator and separator.startswith(head) and not last:
            return False
        self._pending, self._state = after, "text"
        return True

    def _start(self, name: str, said: Said) -> None:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        said.call_piece(len(self.calls) - 1, "", {"id": call["id"], "name": name})
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False

    def _give(self, said: Said, arguments: str) -> None:
        self.calls[-1]["function"]["arguments"] += arguments
        said.call_piece(len(self.calls) - 1, arguments)

    def _say(self, said: Said, text: str) -> None:
        held = self._space + text
        body = held.rstrip()
        if body:
            said.content += body
            self.content += body
        self._space = held[len(body):]


def _name(match: re.Match | None) -> str | None:
    try:
        return None if match is None else json.loads(f'"{match[1]}"')
    except ValueError:  # an escape JSON does not have
        return None


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
