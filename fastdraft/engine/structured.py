"""Structured output: requests whose tokens must follow a JSON schema, any JSON object, a
regular expression, a choice of strings or a grammar (GBNF or Lark), enforced with llguidance.

* :func:`check_constraint` validates a constraint without a tokenizer (about a millisecond), so
  that a bad schema, regex or grammar is refused when the request arrives.
* :class:`StructuredOutputs` (one per engine) starts building the tokenizer's grammar view when
  the engine starts, on a worker thread of its own; compiles each distinct constraint once, on
  that thread (the step loop never waits on a compile: a request joins the batch when its
  grammar is ready); keeps a matcher per constrained sequence, fills the step's token bitmasks
  in one batched call and applies them to those rows only. A request without a constraint costs
  nothing.

llguidance rather than xgrammar: on the 20 schemas of ``benchmarks/bench_structured.py`` it
compiles about 50 times faster at the median and 500 times at the worst (xgrammar takes seconds
over strings bounded by ``maxLength``, a delay to that request's first token), and its slowest
masks are ten times cheaper; xgrammar's median mask is cheaper, but both are microseconds
against a decode step of tens of milliseconds.

Constrained requests decode without speculation, as seeded ones do: a draft token is not
checked against the grammar, and the rejection sampler draws from rows the mask would change.
"""

from __future__ import annotations

import functools
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.gbnf_to_lark
import torch

from fastdraft.engine.sequence import Sequence
from fastdraft.sampling_params import Constraint
from fastdraft.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Compact JSON, as json.dumps writes it: no free whitespace (which a model could pad with until
# max_tokens), one space after ':' and ','. Overrides, so that a schema's own options keep it.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint`` (unchecked: :func:`check_constraint` checks)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(_closed(json.loads(value)), overrides=_JSON_OPTIONS)
    if kind == "json_object":  # an object (OpenAI's JSON mode), with any members
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in json.loads(value)))
    # GBNF (llama.cpp's syntax, ``root`` the start rule), or Lark as llguidance reads it.
    return llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(value))


# Where a JSON schema holds subschemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SCHEMA_ONES = frozenset({"items", "additionalProperties", "unevaluatedProperties", "additionalItems", "contains",
                          "not", "if", "then", "else", "propertyNames"})


def _closed(schema: object) -> object:
    """``schema`` with objects closed where it leaves them open, as OpenAI's strict structured
    outputs (and xgrammar's strict mode) read a schema: an object with ``properties`` and no
    ``additionalProperties`` admits no other members; ``prefixItems`` without ``items``, no
    more items. Otherwise a model may add members until ``max_tokens``."""
    if not isinstance(schema, dict):
        return schema  # true / false
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _closed(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_closed(sub) for sub in value]
        elif key in _SCHEMA_ONES:
            value = _closed(value)
        closed[key] = value
    if "properties" in closed and "additionalProperties" not in closed and "unevaluatedProperties" not in closed:
        closed["additionalProperties"] = False
    if "prefixItems" in closed and "items" not in closed:
        closed["items"] = False
    return closed


@functools.lru_cache(maxsize=1024)
def check_constraint(constraint: Constraint) -> None:
    """``ValueError`` naming what is wrong with ``constraint`` (an invalid JSON schema, regex or
    grammar); no tokenizer needed. A constraint that passed is not checked again (the server
    checks every request, and the engine again)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(_grammar(constraint))
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises a bare Exception
        error = str(e) or type(e).__name__
    if error:
        raise ValueError(f"invalid {constraint.description}: {_first_line(error)}")


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else message)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[rows]`` to -inf where ``bitmask`` (int32, bit ``t % 32`` of word ``t // 32``
    set for an allowed token ``t``) forbids, in place; on any device. Unpacks the bits with
    torch: no compiled kernel, so nothing to build on first use."""
    # logits: [num_rows, vocab_size]; bitmask: [num_rows, ceil(vocab_size / 32)]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask.to(logits.device).index_select(0, index)  # [len(rows), num_words]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :logits.shape[1]]
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


class StructuredOutputs:
    """Grammar state of one engine: compiled constraints by content, a matcher per sequence.

    The tokenizer's grammar view (about a second and a half and a hundred MB for a 150k-token
    vocabulary) is built on the worker thread at the first constraint, or at :meth:`prepare`
    (a server's start)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._compiled: dict[Constraint, Future] = {}  # by content: each distinct constraint once
        self._matchers: dict[int, llguidance.LLMatcher] = {}  # seq_id -> its matcher, once compiled
        self._executor: llguidance.LLExecutor | None = None  # fills a step's masks in parallel; made on first use
        self._compiles = ThreadPoolExecutor(1, thread_name_prefix="fastdraft-grammar")
        self._tokenizer_args = (tokenizer, vocab_size, stop_token_ids)
        self._tokenizer: Future | None = None

    def prepare(self) -> None:
        """Start building the tokenizer's grammar view now, in the background, so that the
        first constrained request does not wait for it."""
        if self._tokenizer is None:
            self._tokenizer = self._compiles.submit(self._build_tokenizer, *self._tokenizer_args)

    @staticmethod
    def _build_tokenizer(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                      eos_token=stop_token_ids or None)

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        # A matcher in its start state; each request gets a copy of it.
        matcher = llguidance.LLMatcher(self._tokenizer.result(), _grammar(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.description}: {_first_line(matcher.get_error())}")
        return matcher

    def submit(self, constraint: Constraint) -> Future:
        """Start compiling ``constraint`` (or find it compiled); its future."""
        future = self._compiled.get(constraint)
        if future is None:
            self.prepare()  # queued before the compile that needs it
            future = self._compiles.submit(self._compile, constraint)
            self._compiled[constraint] = future
        return future

    def is_ready(self, seq: Sequence) -> bool:
        """Whether ``seq``'s grammar is compiled (its matcher made); raises the compile's error."""
        if seq.seq_id in self._matchers:
            return True
        future = self.submit(seq.params.structured_outputs)
        if not future.done():
            return False
        self._matchers[seq.seq_id] = future.result().deep_copy()
        return True

    @property
    def is_active(self) -> bool:
        """Whether any sequence follows a grammar now."""
        return bool(self._matchers)

    def constrained(self, seqs: list[Sequence]) -> list[int]:
        """The indices of ``seqs`` that follow a grammar."""
        if not self._matchers:
            return []
        return [i for i, seq in enumerate(seqs) if seq.seq_id in self._matchers]

    def mask(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, the logits the grammar forbids on ``rows`` (``seqs[i]`` for
        each index ``i`` in ``rows``): one batched bitmask fill, one masked write."""
        # logits: [num_rows, vocab_size]; bitmask rows match the logits' rows, only ``rows`` filled
        bitmask = torch.full((logits.shape[0], -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(self._matchers[seqs[i].seq_id], i) for i in rows],
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        apply_bitmask(logits, bitmask, rows)

    def accept(self, seq: Sequence, token_ids: list[int]) -> bool:
        """Advance ``seq``'s matcher over its new tokens; True once its grammar is complete
        (nothing but the stop token may follow) or broken."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            return False
        if not matcher.consume_tokens(token_ids):
            logger.warning("request %s: its tokens break its grammar: %s", seq.request_id, matcher.get_error())
            return True
        return matcher.is_stopped()

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)
