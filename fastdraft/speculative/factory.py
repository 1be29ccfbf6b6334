"""Building the engine's speculator from a :class:`SpeculativeConfig`: the draft (loaded,
made from the target, or none for n-grams), quantized and with its reduced vocabulary; its
proposer and cache; the draft-length policy with the pass costs it weighs, timed at start."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import replace

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.loader import load_model
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.speculation import Speculator, SpeculatorFactory
from fastdraft.fileio import fastdraft_home, write_json
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.layers.linear import is_dense_linear
from fastdraft.models.files import LoadedModel, build_model, load_state_dict
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model
from fastdraft.speculative.speculative_config import NGRAM, SELF, SpeculativeConfig
from fastdraft.speculative.draft_length import FREE, DraftLengthPolicy, PassCost, measure_pass_cost, timed_sizes
from fastdraft.speculative.draft_vocab import frequent_token_ids, restrict_lm_head
from fastdraft.speculative.proposer import DraftModelProposer, NgramProposer

logger = logging.getLogger(__name__)


def speculator_factory(config: SpeculativeConfig, draft: LoadedModel | None = None) -> SpeculatorFactory:
    """What :class:`~fastdraft.engine.llm_engine.LLMEngine` takes to speculate as ``config``
    says; ``draft``: an already loaded draft model to use (HF's ``assistant_model``). It is
    picklable when ``draft`` is None (an engine process builds its speculator itself)."""
    return functools.partial(build_speculator, config, draft=draft)


def build_speculator(config: SpeculativeConfig, target: LoadedModel, runner: ModelRunner, max_num_seqs: int,
                     draft: LoadedModel | None = None) -> Speculator:
    """The engine's speculator for ``target``, drafting beside its ``runner`` (which runs up
    to ``max_num_seqs`` sequences a step) with the proposer ``config`` describes, its costs
    timed now (a few passes, about a second)."""
    proposer = build_proposer(config, target, runner, draft)
    target_cost = draft_cost = FREE
    plain_cost = None
    if config.is_adaptive:  # a fixed draft length needs no costs
        max_tokens = max_num_seqs * (config.num_speculative_tokens + 1)
        free_blocks = runner.block_manager.num_free_blocks
        target_cost = pass_cost(runner, min(64, max_tokens, free_blocks))
        if runner.graphs is not None:  # plain decode steps replay graphs, verifications run eagerly
            plain_cost = pass_cost(runner, min(64, max_num_seqs, runner.graphs.max_batch, free_blocks), use_graphs=True)
        if isinstance(proposer, DraftModelProposer):
            # A draft pass holds no more rows than the target's (one per drafting sequence).
            draft_cost = pass_cost(proposer.runner, min(64, max_tokens, proposer.runner.block_manager.num_free_blocks))
    policy = DraftLengthPolicy(config.num_speculative_tokens, target_cost, draft_cost, config.is_adaptive,
                               pending_tokens=proposer.pending_tokens, plain_cost=plain_cost)
    return Speculator(proposer, policy)


# Context of the sequences a cost is timed with: attention is part of every pass's cost.
_TIMING_CONTEXT = 128


def _timing_context(runner: ModelRunner, num_seqs: int) -> int:
    """Cached tokens of each sequence a pass of ``num_seqs`` is timed with: as many as fit."""
    pool_tokens = runner.block_manager.num_free_blocks * runner.block_manager.block_size
    return max(min(_TIMING_CONTEXT, pool_tokens // num_seqs - runner.block_manager.block_size), 0)


def pass_cost(runner: ModelRunner, max_size: int, use_graphs: bool = False) -> PassCost:
    """The cost of ``runner``'s decode passes up to ``max_size`` sequences (``measure_pass_cost``).

    A cost depends on the model's shapes and weight formats, the device, the kernels and the
    threads, not on the weights' values or the process: it is timed once for each of those
    and kept under ``$FASTDRAFT_HOME/pass_costs/`` (delete the folder to time again)."""
    model = runner.model
    quant_config = getattr(model, "quant_config", None)
    device = model.device
    kernels = load_cpu_kernels() if device.type == "cpu" else None
    key = json.dumps({
        "config": model.config.to_hf_dict(), "dtype": str(model.dtype),
        "weights": None if quant_config is None else quant_config.to_dict(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "kernels": None if kernels is None else kernels.name, "threads": torch.get_num_threads(),
        "executor": type(runner.decoder).__name__, "block_size": runner.block_manager.block_size,
        "contexts": {size: _timing_context(runner, size) for size in timed_sizes(max_size)},
        "use_graphs": use_graphs,
    }, sort_keys=True, default=str)
    path = fastdraft_home() / "pass_costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        return PassCost([(int(size), float(seconds)) for size, seconds in json.loads(path.read_text())["points"]])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not timed yet, or unreadable: time it
    cost = measure_pass_cost(
        lambda n: runner.time_pass(n, _timing_context(runner, n), use_graphs=use_graphs), max_size)
    try:
        write_json(path, {"points": list(zip(cost.sizes, cost.seconds))})
    except OSError as exc:
        logger.warning("could not keep the pass costs in %s: %s", path, exc)
    return cost


def check_vocab_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ``ValueError`` unless both tokenizers map every shared token to the same id.

    The models' embedding sizes may differ (Qwen pads its vocabulary to a multiple of 128);
    draft probabilities are zero-padded to the target's size during verification. Models built
    in code without a tokenizer (token-id prompts only) must have the same vocabulary size.
    """
    if target.tokenizer is None or draft.tokenizer is None:
        if target.config.vocab_size != draft.config.vocab_size:
            raise ValueError(f"without a tokenizer to compare, the draft's vocabulary ({draft.config.vocab_size}) "
                             f"must be the target's ({target.config.vocab_size})")
        return
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
