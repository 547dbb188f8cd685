# Reading a chat's output for tool calls as it streams, in the one format this server
# asks a model for (Hermes's, which Qwen2.5 and Qwen3 are trained on):
#     <tool_call>\n{"name": "NAME", "arguments": ARGUMENTS}\n</tool_call>
# Text outside the tags is the message's content. A call's arguments go out as they
# come; a tail that may yet turn out to be a tag (or a call's closing) waits until known.

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class Said:
    """What one read adds to the message: content, and tool-call pieces in OpenAI's
    streamed shape (the first piece of a call carries its id and name)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def call_piece(self, index: int, arguments: str, opening: dict | None = None) -> None:
        if self.calls and self.calls[-1]["index"] == index:  # one piece a call a delta
            self.calls[-1]["function"]["arguments"] += arguments
        elif opening is not None or arguments:
            piece = {"index": index, **(opening or {}), "function": {"arguments": arguments}}
            if opening is not None:
                piece["function"] = {"name": opening.pop("name"), "arguments": arguments}
                piece |= opening
            self.calls.append(piece)

    def delta(self) -> dict:
        out = {"content": self.content} if self.content else {}
        return out | ({"tool_calls": self.calls} if self.calls else {})


class CallReader:
    """One choice's output, read piece by piece.
    `name`: the output is that function's arguments alone (tool_choice naming it)."""

    def __init__(self, name: str | None = None):
        self.bare = name is not None
        self.calls: list[dict] = []  # whole, in the message's shape
        self.content = ""
        self._state = "text"
        self._pending = ""  # read, not yet given out
        self._space = ""  # content's trailing whitespace, held: it may only lead to a call
        self._unsaid = Said()  # a named call's opening, said with the first read
        if name is not None:
            self._start(name, self._unsaid)

    def read(self, text: str, last: bool = False) -> Said:
        """What `text` adds; `last`: the output ends with it, so nothing is held back."""
        said, self._unsaid = self._unsaid, Said()
        self._pending += text
        self._advance(said, final=last)
        if last:
            if self._state == "header":  # cut before its name: it was text after all
                self._say(said, OPEN + self._pending)
            if not self.calls:
                said.content += self._space
                self.content += self._space
            self._pending = self._space = ""
        return said

    def _advance(self, said: Said, final: bool) -> None:
        while True:
            if self._state == "text":
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = 0 if final else partial_tail(self._pending, OPEN)
                    self._say(said, self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return
                self._say(said, self._pending[:at])
                self._pending, self._state = self._pending[at + len(OPEN):], "header"
                self._space = ""
            elif self._state == "header":
                match = HEADER.match(self._pending)
                if match is None:
                    return
                self._start(json.loads(f'"{match[1]}"'), said)
                self._pending = self._pending[match.end():]
            else:
                if not self._arguments(said, final):
                    return

    def _arguments(self, said: Said, final: bool) -> bool:
        """Give out the current call's arguments read so far; True once it closed."""
        end = self._pending.find(CLOSE)
        if not self.bare and (end >= 0 or final):
            rest = self._pending[:end] if end >= 0 else self._pending
            given = self.calls[-1]["function"]["arguments"]
            self._give(said, _without_closing(given, rest, certain=end >= 0))
            self._pending = self._pending[end + len(CLOSE):] if end >= 0 else ""
            self._state = "text"
            return end >= 0
        keep = 0 if self.bare else _closing_tail(self._pending)
        self._give(said, self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _start(self, name: str, said: Said) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        said.call_piece(len(self.calls) - 1, "", {"id": call["id"], "type": "function",
                                                  "name": name})
        self._state = "arguments"
        return call

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


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _closing_tail(text: str) -> int:
    """The length of the end of a call's text that may be its closing `}` and tag: from
    its last brace, where what follows may still become `</tool_call>`."""
    at = text.rfind("}")
    if at >= 0 and CLOSE.startswith(text[at + 1:].lstrip()):
        return len(text) - at
    return 0


def _without_closing(given: str, rest: str, certain: bool) -> str:
    """The rest of a call's arguments: `rest` (what follows those `given`) less the brace
    that closes the call's own object. Where the call was cut short (not `certain`),
    only if the arguments before that brace are whole JSON."""
    body = rest.rstrip()
    if not certain:  # its closing tag, cut short
        body = body[:len(body) - partial_tail(body, CLOSE)].rstrip()
    if body.endswith("}"):
        inner = body[:-1].rstrip()
        if certain:
            return inner
        try:
            json.loads(given + inner)
            return inner
        except ValueError:
            pass
    return body if certain else rest
