# A reasoning model's thinking told apart from its answer: what it writes inside
# <think>...</think> (Qwen3, DeepSeek-R1 and the models distilled from it) goes out as
# `reasoning_content`, the rest as the reply. A chat template that opens the block
# itself (DeepSeek-R1's prompt ends with "<think>\n") starts the output inside it.

from __future__ import annotations

import json

from api.tool_reader import partial_tail
from pipeline.messages import Structure
from pipeline.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"
CLOSINGS = [CLOSE + "\n\n", CLOSE + "\n", CLOSE]  # the whitespace before an answer is the tag's


def reasoning_start(tokenizer: Tokenizer, prompt_ids: list[int]) -> str | None:
    """None for a model that does not think in tags (its chat template never closes
    a <think> block) or where the prompt closed the block (Qwen3's enable_thinking
    false); else "inside" where the prompt opened it, "before"."""
    if CLOSE not in (tokenizer.chat_template or ""):
        return None
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    if tail.endswith(CLOSE):
        return None
    return "inside" if tail.endswith(OPEN) else "before"


def reasoning_tokens(tokenizer: Tokenizer, start: str | None, output_ids: list[int]) -> int:
    """How many of the output's tokens are its thought (`start`: reasoning_start's),
    up to the one that completes </think>; all of them where the thought never ended."""
    if start is None or not output_ids:
        return 0
    text = tokenizer.decode(output_ids, skip_special_tokens=False)
    if start == "before" and not text.lstrip().startswith(OPEN):
        return 0  # it answered without a thought
    if CLOSE not in text:
        return len(output_ids)
    low, high = 1, len(output_ids)  # the shortest head whose text holds </think>
    while low < high:
        middle = (low + high) // 2
        if CLOSE in tokenizer.decode(output_ids[:middle], skip_special_tokens=False):
            high = middle
        else:
            low = middle + 1
    return low


def think_first(structure: Structure | None, start: str | None) -> Structure | None:
    """`structure` (response_format's, or tool calls') held only after a thought: a
    reasoning model thinks first, as it was trained to, then answers in the structure."""
    if structure is None or start is None:
        return structure
    if structure.kind == "structural_tag":
        answer = json.loads(structure.schema)["format"]
    else:
        schema = json.loads(structure.schema) if structure.kind == "json_schema" \
            else {"type": "object"}
        answer = {"type": "json_schema", "json_schema": schema}
    thought = {"type": "tag", "begin": "" if start == "inside" else OPEN,
               "content": {"type": "any_text"}, "end": CLOSINGS}
    if start == "before":  # a model may answer without a thought
        thought = {"type": "optional", "content": thought}
    form = {"type": "sequence", "elements": [thought, answer]}
    return Structure(kind="structural_tag",  # an error about it names the answer's field
                     schema=json.dumps({"type": "structural_tag", "format": form}),
                     field=structure.field)


class ThoughtReader:
    """One choice's output, read piece by piece: each read gives (thought, answer)."""

    def __init__(self, start: str):
        self.reasoning, self.content = "", ""
        self._state = "opened" if start == "inside" else "start"
        self._pending = ""

    def read(self, text: str, last: bool = False) -> tuple[str, str]:
        """What `text` adds to the thought and to the answer; `last`: the output ends."""
        self._pending += text
        thought = answer = ""
        while True:
            if self._state == "start":  # the output may open with a thought
                head = self._pending.lstrip()
                if head.startswith(OPEN):
                    self._pending, self._state = head[len(OPEN):], "opened"
                elif OPEN.startswith(head) and not last:
                    break
                else:
                    self._state = "answer"
            elif self._state in ("opened", "closed"):  # whitespace after a tag is the tag's
                self._pending = self._pending.lstrip()
                if not self._pending and not last:
                    break
                self._state = "thinking" if self._state == "opened" else "answer"
            elif self._state == "thinking":
                at = self._pending.find(CLOSE)
                if at >= 0:
                    thought += self._pending[:at]
                    self._pending, self._state = self._pending[at + len(CLOSE):], "closed"
                    continue
                keep = 0 if last else partial_tail(self._pending, CLOSE)
                thought += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                break
            else:
                answer, self._pending = answer + self._pending, ""
                break
        self.reasoning += thought
        self.content += answer
        return thought, answer
