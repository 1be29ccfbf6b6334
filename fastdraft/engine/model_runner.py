"""Runs one scheduled step: a flat batch through the model, then a token for each sequence
that reached the end of its tokens."""

from __future__ import annotations

import time

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.scheduler import SchedulerOutput
from fastdraft.engine.sequence import Sequence
from fastdraft.kernels.fused import is_paged_block_size
from fastdraft.kernels.mode import batch_invariant
from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.sampler import apply_penalties, make_generator, sample_batch
from fastdraft.models.llama import LlamaForCausalLM


class ModelRunner:
    """Owns the paged KV cache and each request's random generator.

    ``execute`` builds the step's flat inputs and metadata from the block tables, runs the
    model once over every scheduled token, computes logits only for the rows that sample
    (a sequence's last token), and samples each of those rows with its own request's
    parameters and generator: a seeded request's draws never depend on what else runs (its
    logits do not either: with ``batch_invariant`` each step runs in
    :func:`~fastdraft.kernels.mode.batch_invariant` mode, where every kernel is row-invariant)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, block_manager: BlockManager,
                 eos_token_ids: set[int] | None = None, batch_invariant: bool = True) -> None:
        if kv_cache.block_size != block_manager.block_size or kv_cache.num_blocks != block_manager.num_blocks:
            raise ValueError("the KV cache and the block manager must agree on block size and count")
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.batch_invariant = batch_invariant
        # All decoder layers in one C++ call per step, built once here; None: the model's module
        # path (hooks, no CPU kernels, CUDA, a block size the C++ attention does not take).
        self.decoder = model.fused_decoder() if is_paged_block_size(kv_cache.block_size) else None
        self._generators: dict[int, torch.Generator] = {}
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else set()  # the engine's own set
        # The log-probabilities of the last step's sampled tokens, for requests that ask
        # (seq_id -> (chosen token's logprob, [(token id, logprob)] of the top ``logprobs``)).
        self.last_logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        # Wall time spent preparing and running the model, and sampling, over all steps.
        self.forward_seconds = 0.0
        self.sample_seconds = 0.0

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence's generator."""
        self._generators.pop(seq.seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.seq_id not in self._generators:
            self._generators[seq.seq_id] = make_generator(seq.params.seed, self.model.device)
        return self._generators[seq.seq_id]

    def prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, PagedAttentionMetadata, list[int],
                                                        list[Sequence]]:
        """(input ids [num_tokens], metadata, the flat row of each sampling sequence's last token,
        those sequences)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq, num in zip(output.seqs, output.num_scheduled_tokens):
            start = seq.num_computed_tokens
            tokens = seq.token_ids
            input_ids.extend(tokens[start:start + num])
            for position in range(start, start + num):
                positions.append(position)
                slots.append(self.block_manager.slot(seq, position))
            query_start_loc.append(query_start_loc[-1] + num)
            context_lens.append(start + num)
            if start + num == seq.num_tokens:
                sample_rows.append(query_start_loc[-1] - 1)
                samplers.append(seq)
        max_blocks = max(len(seq.block_table) for seq in output.seqs)
        tables = torch.zeros(len(output.seqs), max_blocks, dtype=torch.long)
        for i, seq in enumerate(output.seqs):
            tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.long)
        device = self.model.device
        meta = PagedAttentionMetadata(torch.tensor(positions, device=device), torch.tensor(slots, device=device),
                                      query_start_loc, context_lens, tables.to(device))
        return torch.tensor(input_ids, device=device), meta, sample_rows, samplers

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[int, int]:
        """Run ``output``'s step; the sampled token of each sequence that sampled, by ``seq_id``."""
        start = time.perf_counter()
        input_ids, meta, sample_rows, samplers = self.prepare(output)
        with batch_invariant(self.batch_invariant):
            logits = None  # [num_sampling_seqs, vocab_size]
            if self.decoder is not None and sample_rows:  # the LM head inside the C++ call, where it can run
                logits = self.model.paged_logits(input_ids.unsqueeze(0), self.kv_cache, meta, self.decoder,
                                                 sample_rows)
            if logits is None:
                hidden = self.model(input_ids.unsqueeze(0), self.kv_cache, meta, self.decoder)  # [1, num_tokens, hidden]
                logits = self.model.compute_logits(hidden[0, sample_rows]) if sample_rows else None
        self.forward_seconds += time.perf_counter() - start
        if logits is None:
            return {}
        # logits: [num_sampling_seqs, vocab_size]
        start = time.perf_counter()
        processed = logits  # copied on the first row a penalty or min_tokens changes
        for i, seq in enumerate(samplers):
            params = seq.params
            original = logits[i]  # [vocab_size]
            row = apply_penalties(original, seq.prompt_token_ids, seq.output_token_ids, params)
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
                row = row.index_add(0, ids, bias)
            if len(seq.output_token_ids) < params.min_tokens and self.eos_token_ids:
                eos_ids = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long, device=row.device)
                row = row.index_fill(0, eos_ids, float("-inf"))
            if row is not original:
                processed = logits.clone() if processed is logits else processed
                processed[i] = row
        token_ids = sample_batch(processed, [seq.params for seq in samplers],
                                 [self._generator(seq) for seq in samplers]).tolist()  # [num_sampling_seqs]
        self.last_logprobs = {}
        for i, (seq, token) in enumerate(zip(samplers, token_ids)):
            num_top = seq.params.logprobs
            if num_top is not None:
                # Of the model's own distribution, before penalties and temperature (as vLLM reports them).
                logprobs = torch.log_softmax(logits[i], dim=-1)  # [vocab_size]
                top = torch.topk(logprobs, num_top) if num_top else None
                pairs = [] if top is None else [(int(t), float(v)) for v, t in zip(top.values, top.indices)]
                self.last_logprobs[seq.seq_id] = (float(logprobs[token]), pairs)
        self.sample_seconds += time.perf_counter() - start
        return {seq.seq_id: token for seq, token in zip(samplers, token_ids)}
