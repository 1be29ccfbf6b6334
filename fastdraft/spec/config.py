"""Speculative decoding configuration and proposer construction."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.loader import load_model
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.fileio import fastdraft_home
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.layers.linear import is_dense_linear
from fastdraft.models.loader import LoadedModel, build_model, load_state_dict, parse_device
from fastdraft.quant.config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.spec.draft_length import FREE, DraftLengthPolicy, measure_pass_cost
from fastdraft.spec.draft_vocab import frequent_token_ids, restrict_lm_head
from fastdraft.spec.proposer import DraftModelProposer, NgramProposer
from fastdraft.spec.speculator import EngineSpeculator

logger = logging.getLogger(__name__)

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
    # proposes, so a coarser head costs acceptance, never exactness; for Qwen2.5-Coder-0.5B the
    # INT8 head is 40% of the bytes a draft step reads.
    draft_lm_head_bits: int = 4
    # The draft's LM head keeps only this many tokens: the special ones, then the most frequent
    # of the calibration corpus (spec/draft_vocab.py). Exact whatever the size; None keeps all.
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

    def start(self, target: LoadedModel, runner: ModelRunner, max_num_seqs: int,
              draft: LoadedModel | None = None) -> EngineSpeculator:
        """The engine's speculator for ``target``, drafting beside its ``runner`` (which runs
        up to ``max_num_seqs`` sequences a step) with the proposer this config describes, its
        costs timed now (a few passes, about a second)."""
        proposer = build_proposer(self, target, runner, draft)
        target_cost = draft_cost = FREE
        if self.is_adaptive:  # a fixed draft length needs no costs
            max_tokens = max_num_seqs * (self.num_speculative_tokens + 1)
            target_cost = measure_pass_cost(lambda n: _time_pass(runner, n),
                                            min(64, max_tokens, runner.block_manager.num_free_blocks))
            if isinstance(proposer, DraftModelProposer):
                draft_cost = measure_pass_cost(lambda n: _time_pass(proposer.runner, n),
                                               min(64, proposer.runner.block_manager.num_free_blocks))
        policy = DraftLengthPolicy(self.num_speculative_tokens, target_cost, draft_cost, self.is_adaptive,
                                   pending_tokens=proposer.pending_tokens)
        return EngineSpeculator(proposer, policy)


# Context of the sequences a cost is timed with: attention is part of every pass's cost.
_TIMING_CONTEXT = 128


def _time_pass(runner: ModelRunner, num_seqs: int) -> float:
    """Seconds of a decode pass of ``num_seqs`` sequences, with as much context as fits."""
    pool_tokens = runner.block_manager.num_free_blocks * runner.block_manager.block_size
    context = min(_TIMING_CONTEXT, pool_tokens // num_seqs - runner.block_manager.block_size)
    return runner.time_pass(num_seqs, max(context, 0))


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ``ValueError`` unless both tokenizers map every shared token to the same id.

    The models' embedding sizes may differ (Qwen pads its vocabulary to a multiple of 128);
    draft probabilities are zero-padded to the target's size during verification.
    """
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        only_draft = len(set(draft_vocab.items()) - set(target_vocab.items()))
        raise ValueError(
            f"the draft's tokenizer differs from the target's ({only_target} token/id pairs only in the target, "
            f"{only_draft} only in the draft); speculative decoding needs the same tokenizer"
        )
    if draft.config.vocab_size > target.config.vocab_size and \
            max(draft_vocab.values()) >= target.config.vocab_size:
        raise ValueError("the draft's vocabulary is larger than the target's embedding table")


def _restrict_draft_head(draft: LoadedModel, config: SpeculativeConfig) -> torch.Tensor | None:
    """Shrink a dense draft head to ``config.draft_vocab_size`` frequent tokens; the kept ids
    [draft_vocab] (sorted), or None when the head keeps the full vocabulary."""

    vocab_size = draft.config.vocab_size
    if config.draft_vocab_size is None or config.draft_vocab_size >= vocab_size:
        return None
    if not is_dense_linear(draft.model.lm_head):
        logger.info("the draft's LM head is already quantized; it keeps the full vocabulary")
        return None
    token_ids = frequent_token_ids(draft.tokenizer, config.draft_vocab_size, vocab_size,
                                   cache_dir=fastdraft_home() / "draft_vocab")
    restrict_lm_head(draft.model, token_ids)
    logger.info("draft LM head: %d of %d tokens", len(token_ids), vocab_size)
    return token_ids.to(draft.model.device)


def _quantize_draft(draft: LoadedModel, config: SpeculativeConfig) -> LoadedModel:
    """Quantize a dense draft in place as ``config.draft_low_bit`` asks (RTN)."""

    if config.draft_low_bit is None or getattr(draft.model, "quant_config", None) is not None:
        return draft
    cfg = draft.config
    in_features = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
    # The requested group size where it divides every layer, else the largest smaller one that does.
    group = next((g for g in (config.draft_group_size, 64, 32)
                  if g <= config.draft_group_size and all(d % g == 0 for d in in_features)), -1)
    quant_config = replace(QuantConfig.from_low_bit(config.draft_low_bit, group_size=group),
                           lm_head_bits=max(config.draft_lm_head_bits, 8) if config.draft_low_bit == "int8"
                           else config.draft_lm_head_bits)
    quantize_model(draft.model, quant_config, show_progress=False)
    return draft


def prepare_draft(draft: LoadedModel, config: SpeculativeConfig) -> tuple[LoadedModel, torch.Tensor | None]:
    """A freshly loaded draft made cheap: its head restricted to frequent tokens, then
    quantized. Returns the draft and the token ids its head keeps (None: all)."""
    token_ids = _restrict_draft_head(draft, config)
    return _quantize_draft(draft, config), token_ids


def make_self_draft(target: LoadedModel, config: SpeculativeConfig,
                    device: torch.device) -> tuple[LoadedModel, torch.Tensor | None]:
    """The target's own weights, quantized on the fly: a draft with no second model to find.
    Returns the draft and the token ids its head keeps (None: all)."""
    model = build_model(target.config, load_state_dict(target.model_dir), target.model.dtype, device)
    draft = LoadedModel(model=model, tokenizer=target.tokenizer, config=target.config, model_dir=target.model_dir)
    return prepare_draft(draft, config)


def build_proposer(config: SpeculativeConfig, target: LoadedModel, runner: ModelRunner,
                   draft: LoadedModel | None = None) -> DraftModelProposer | NgramProposer:
    """The proposer ``config`` describes, drafting for ``target`` beside its engine's
    ``runner``. An already loaded ``draft`` model (HF's ``assistant_model``) is used as is
    instead of loading ``config.draft``."""
    if config.draft == NGRAM:
        return NgramProposer()
    device = torch.device(config.draft_device) if config.draft_device else target.model.device
    token_ids = None
    if draft is not None:
        check_vocab_compatible(target, draft)
        device = draft.model.device
    elif config.draft == SELF:
        draft, token_ids = make_self_draft(target, config, device)
    else:
        dtype = config.draft_dtype or target.model.dtype
        draft = load_model(config.draft, dtype=dtype, device=device)
        check_vocab_compatible(target, draft)
        draft, token_ids = prepare_draft(draft, config)
    block_manager = runner.block_manager
    is_shared = (config.draft == SELF and config.is_cache_shared and device == target.model.device
                 and draft.model.dtype == target.model.dtype)
    if is_shared:  # the draft writes its guesses into the target's own blocks
        draft_runner = ModelRunner(draft.model, runner.kv_cache, block_manager, batch_invariant=False)
    else:  # as many tokens of cache as the target's pool, in the draft's own blocks
        cache = PagedKVCache.from_config(draft.config, block_manager.num_blocks, block_manager.block_size,
                                         draft.model.dtype, device)
        draft_runner = ModelRunner(draft.model, cache, BlockManager(block_manager.num_blocks, block_manager.block_size,
                                                                    enable_prefix_caching=False),
                                   batch_invariant=False)
    return DraftModelProposer(draft_runner, target.config.vocab_size, shares_target_cache=is_shared,
                              min_confidence=config.min_confidence, token_ids=token_ids)
