# Structured output (response_format, tool calls): a request's tokens held to JSON, to
# what a JSON schema admits, or to a structural tag (text and tagged calls), by xgrammar's
# matchers. Each step, a constrained row's logits keep only the tokens its matcher allows
# next; each token picked is fed back to it.

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import InvalidRequest
from pipeline.messages import Structure

ANY_OBJECT = '{"type": "object"}'
BARRED = np.uint32(0xFF800000)  # -inf's bits as a float32
CACHED = 64  # compiled grammars kept, least recently used dropped
# xgrammar's errors begin with a time and its C++ source's place: not the client's business
SOURCE_PREFIX = re.compile(r"^\[[^]]*\] \S+:\d+: (Check failed: .*? is false: )?")


class Grammars:
    """Grammars compiled for one model's tokenizer (lazily: a tier that never gets a
    response_format never loads xgrammar), cached by their source."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_ids: list[int]):
        self.model_dir, self.vocab_size, self.stop_ids = model_dir, vocab_size, stop_ids
        self.compiled: OrderedDict[Structure, object] = OrderedDict()
        self._compiler = None
        self._compiler_made = threading.Lock()  # the grammar thread's, or a step's

    def matcher(self, structure: Structure, output_ids: list[int]):
        """A matcher at the start of the output, moved past `output_ids` (a
        continuation's tokens, already delivered); InvalidRequest for a bad schema."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self._compile(structure))
        for token_id in output_ids:
            if not matcher.accept_token(token_id):
                raise InvalidRequest("the delivered output does not follow response_format")
        return matcher

    def ready(self, structure: Structure) -> bool:
        return structure in self.compiled

    def _compile(self, structure: Structure):
        if structure in self.compiled:
            self.compiled.move_to_end(structure)
            return self.compiled[structure]
        return self.keep(structure, self.compile(structure))

    def compile(self, structure: Structure):
        """The grammar for `structure`, not kept: callable from another thread (it
        releases the GIL), as a long compile must not hold up the scheduler's steps."""
        if structure.kind not in ("json_object", "json_schema", "structural_tag"):
            raise InvalidRequest(f"unknown structure {structure.kind!r}")
        compiler = self.compiler()
        try:
            if structure.kind == "json_object":  # an object, any members (not any value)
                return compiler.compile_json_schema(ANY_OBJECT, strict_mode=False)
            if structure.kind == "json_schema":
                return compiler.compile_json_schema(structure.schema)
            # tool calls (api/tools.py): text and tagged calls
            return compiler.compile_structural_tag(structure.schema)
        except (RuntimeError, ValueError) as error:  # xgrammar's word for a bad schema
            reason = SOURCE_PREFIX.sub("", str(error).strip())
            raise InvalidRequest(f"{_what(structure)}: {reason}",
                                 param=field_of(structure)) from None

    def keep(self, structure: Structure, grammar):
        self.compiled[structure] = grammar
        while len(self.compiled) > CACHED:
            self.compiled.popitem(last=False)
        return grammar

    def compiler(self):
        with self._compiler_made:
            return self._make_compiler()

    def _make_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise InvalidRequest("response_format needs the xgrammar package on the "
                                     "scheduler (`make install` adds it)") from None
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler


def field_of(structure: Structure) -> str:
    """The request field a structure comes from, which an error about it names."""
    return structure.field or ("tools" if structure.kind == "structural_tag"
                               else "response_format")


def _what(structure: Structure) -> str:
    field = field_of(structure)
    return "a tool's parameters" if field == "tools" else f"{field}'s schema"


def constrain(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """Rows whose matcher is not None keep only the tokens it allows next (a copy
    of `logits`, where any row is constrained): a barred token's logit is -inf."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)  # bit t of a row: t allowed
    for i, row in enumerate(rows):
        matchers[row].fill_next_token_bitmask(bitmask, i)
    if logits.device.type == "cpu":
        penalty = penalty_bitwise(bitmask, vocab)
    else:
        penalty = penalty_shifted(bitmask.to(logits.device), vocab)
    index = torch.tensor(rows, device=logits.device)
    return logits.index_add(0, index, penalty.to(logits.dtype))


def penalty_bitwise(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 to add to logits: 0 where a bit allows the token, -inf
    where it bars it. numpy's unpacking, -inf made as bits: on a Zen 4 core 0.23 ms for
    16 rows where torch's shifts took 2.9 (`bench/grammar_mask.py`)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(((bits[:, :vocab] ^ 1).astype(np.uint32) * BARRED).view(np.float32))


def penalty_shifted(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """penalty_bitwise's result by torch's ops, on the bitmask's device (a GPU's)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab]
    return torch.zeros(bits.shape, device=bitmask.device).masked_fill(bits == 0, -math.inf)
