"""A smaller LM head for the draft: only the tokens that text actually uses.

A draft step reads its LM head like any other weight. For Qwen2.5-Coder-0.5B the INT4 head
(151936 x 896) is about a quarter of the bytes a draft step reads, yet CPython's standard
library and the calibration prose, 2.8M tokens, use only about 31K distinct ids. As in FR-Spec
(Zhao et al., 2025), the draft's head keeps only the most frequent tokens of that corpus,
plus every special token. Speculative decoding stays exact for any draft distribution: the
draft never proposes a dropped token, and when the target wants one, verification emits it as
the recovered or bonus token. Only acceptance can change, by the little probability mass the
dropped tokens carry.

The ranking is computed once per tokenizer and Python build, since the corpus is that
build's standard library, and cached under ``$FASTDRAFT_HOME/draft_vocab``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from fastdraft.fileio import write_json
from fastdraft.layers.linear import Linear, is_dense_linear
from fastdraft.quant.data import calibration_texts
from fastdraft.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def corpus_texts() -> list[str]:
    """The ranking corpus: the calibration texts (never the selection or test texts)."""

    return calibration_texts()


def token_counts(tokenizer: Tokenizer, texts: list[str]) -> Counter:
    """How often each token id occurs in ``texts``."""
    counts: Counter = Counter()
    for ids in tokenizer.encode_batch(texts):
        counts.update(ids)
    return counts


def _ranking_cache_path(tokenizer: Tokenizer, cache_dir: Path) -> Path:
    key = hashlib.sha256((tokenizer.fingerprint() + sys.version).encode()).hexdigest()[:20]
    return cache_dir / f"{key}.json"


def ranked_token_ids(tokenizer: Tokenizer, cache_dir: Path | None = None) -> list[int]:
    """Token ids of the ranking corpus, most frequent first (ties by id)."""
    path = _ranking_cache_path(tokenizer, cache_dir) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return [int(i) for i in json.loads(path.read_text())["ranked_ids"]]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a corrupt draft vocabulary cache at %s", path)
    counts = token_counts(tokenizer, corpus_texts())
    ranked = sorted(counts, key=lambda i: (-counts[i], i))
    if path is not None:
        write_json(path, {"num_corpus_tokens": sum(counts.values()), "ranked_ids": ranked})
    return ranked


def frequent_token_ids(tokenizer: Tokenizer, max_tokens: int, vocab_size: int,
                       cache_dir: Path | None = None) -> torch.Tensor:
    """Sorted ids [<= max_tokens] a draft head keeps: the special tokens, then the corpus's
    most frequent tokens, all below ``vocab_size`` (the model's embedding rows)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    special = sorted(i for i in tokenizer.special_token_ids() if i < vocab_size)
    kept = dict.fromkeys(special[:max_tokens])
    for token_id in ranked_token_ids(tokenizer, cache_dir):
        if len(kept) >= max_tokens:
            break
        if token_id < vocab_size:
            kept.setdefault(token_id)
    return torch.tensor(sorted(kept), dtype=torch.long)


def restrict_lm_head(model: nn.Module, token_ids: torch.Tensor) -> None:
    """Replace ``model.lm_head`` (a dense ``nn.Linear``) by one over the rows ``token_ids``:
    ``compute_logits`` then returns ``[..., len(token_ids)]``. A tied embedding stays whole."""
    head = model.lm_head
    if not is_dense_linear(head):
        raise ValueError(f"only a dense LM head can be restricted, not {type(head).__name__}")
    weight = head.weight.detach()  # [vocab_size, hidden_size]
    rows = token_ids.to(weight.device)
    small = Linear(weight.shape[1], len(rows), bias=head.bias is not None,
                   device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        small.weight.copy_(weight[rows])
        if head.bias is not None:
            small.bias.copy_(head.bias.detach()[rows])
    model.lm_head = small
