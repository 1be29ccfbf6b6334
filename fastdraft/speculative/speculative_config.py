"""Speculative decoding's configuration; ``speculative/factory.py`` builds what it describes."""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.models.files import parse_device

SELF = "self"
NGRAM = "ngram"


@dataclass
class SpeculativeConfig:
    """How to speculate.

    ``draft`` is ``"self"`` (the target's own INT4 copy, made at load time), ``"ngram"``
    (prompt lookup), or a model of the same tokenizer (known name, HF folder or .gguf).
    """

    draft: str = SELF
    num_speculative_tokens: int = 4
    is_adaptive: bool = True  # k per sequence from acceptance, batch size and costs; 0 when it does not pay
    # A sequence stops a step's drafting after a token whose draft probability fell below this
    # (0: never).
    min_confidence: float = 0.5
    draft_low_bit: str | None = "sym_int4"  # how the draft is quantized on load (None: as stored)
    draft_group_size: int = 128
    # The draft's LM head: 4 (INT4, like its linears), 8 (INT8 per channel) or 16. A draft only
    # proposes, so a coarser head costs acceptance, never exactness (docs/speculative.md has
    # its share of a draft step's bytes).
    draft_lm_head_bits: int = 4
    # The draft's LM head keeps only this many tokens: the special ones, then the most frequent
    # of the calibration corpus (speculative/draft_vocab.py). Exact whatever the size; None keeps all.
    draft_vocab_size: int | None = 32768
    draft_dtype: str | None = None  # a separate draft's dtype; default: the target's
    draft_device: str | None = None  # e.g. "cpu" beside a CUDA target; default: the target's
    is_cache_shared: bool = True  # "self" on the target's device: draft writes into the target's KV cache

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 7:
            raise ValueError(f"num_speculative_tokens must be in 1..7, got {self.num_speculative_tokens}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if self.draft_low_bit not in ("sym_int4", "asym_int4", "int8", None):
            raise ValueError(f"draft_low_bit must be sym_int4, asym_int4 or int8, got {self.draft_low_bit!r}")
        if self.draft_lm_head_bits not in (4, 6, 8, 16):
            raise ValueError(f"draft_lm_head_bits must be 4, 6, 8 or 16, got {self.draft_lm_head_bits}")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int)
                                                  or self.draft_vocab_size < 1):
            raise ValueError(f"draft_vocab_size must be a positive int or None, got {self.draft_vocab_size!r}")
        if not self.draft:
            raise ValueError("draft must name 'self', 'ngram' or a model")
        if self.draft_device is not None:
            parse_device(self.draft_device, "draft_device")
