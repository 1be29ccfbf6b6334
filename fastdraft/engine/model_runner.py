"""Runs one scheduled step: a flat batch through the model, then a token for each sequence
that reached the end of its tokens."""

from __future__ import annotations

import secrets
import statistics
import time

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.cuda_graphs import CudaGraph, DecodeGraphs
from fastdraft.engine.scheduler import SchedulerOutput
from fastdraft.engine.sequence import Sequence
from fastdraft.engine.structured import StructuredOutputs
from fastdraft.kernels.mode import batch_invariant
from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache, Span, flat_batch
from fastdraft.layers.rejection_sampler import rejection_sample_batch, rejection_sample_keyed
from fastdraft.layers.sampler import apply_extras, changes_logits, make_generator, sample_batch
from fastdraft.models.cuda_decoder import CudaDecoder
from fastdraft.models.causal_lm import CausalLM


class ModelRunner:
    """Owns the paged KV cache and each request's random generator.

    ``execute`` builds the step's flat inputs and metadata from the block tables, runs the
    model once over every scheduled token, computes logits only for the rows that sample
    (a sequence's last token), and samples each of those rows with its own request's
    parameters and generator: a seeded request's draws never depend on what else runs (its
    logits do not either: with ``batch_invariant`` each step runs in
    :func:`~fastdraft.kernels.mode.batch_invariant` mode, where every kernel is row-invariant)."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, block_manager: BlockManager,
                 eos_token_ids: frozenset[int] | set[int] | None = None, batch_invariant: bool = True) -> None:
        # The cache may hold blocks past the manager's: a CUDA graph's padding rows read one.
        if kv_cache.block_size != block_manager.block_size or kv_cache.num_blocks < block_manager.num_blocks:
            raise ValueError("the KV cache must have the block manager's block size and at least its blocks")
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.batch_invariant = batch_invariant
        # The fused step, built once here: all decoder layers in one C++ call on a CPU, Triton
        # kernels and fused matmuls on a GPU. None: the model's module path (hooks, no CPU
        # kernels or Triton, a block size neither attention takes).
        self.decoder = model.fused_decoder(kv_cache.block_size)
        self.graphs: DecodeGraphs | None = None  # pure-decode steps from CUDA graphs (capture_graphs)
        self._generators: dict[int, torch.Generator] = {}
        # On a GPU, sampled rows draw from a stream keyed by (seed, draw index) in one batch of
        # launches instead of a generator per request (``layers/sampler.py::keyed_uniforms``).
        self.keyed_sampling = model.device.type == "cuda"
        self._seeds: dict[int, int] = {}  # seq_id -> the seed of its keyed stream
        # Grammar state of constrained requests (the engine sets it on the first one).
        self.structured: StructuredOutputs | None = None
        # Masked while a request is short of its min_tokens (the scheduler owns finishing on them).
        self.eos_token_ids = frozenset(eos_token_ids or ())
        # The log-probabilities of the last step's sampled tokens, for requests that ask
        # (seq_id -> (chosen token's logprob, [(token id, logprob)] of the top ``logprobs``)).
        self.last_logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        # Wall time spent preparing and running the model, and sampling, over all steps.
        self.forward_seconds = 0.0
        self.sample_seconds = 0.0

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, graph_type: type = CudaGraph) -> bool:
        """Capture CUDA graphs for pure-decode steps of up to ``max_num_seqs`` sequences (see
        ``engine/cuda_graphs.py``); whether they were (they need the GPU step and a spare cache
        block past the block manager's for padding rows to read)."""
        if not isinstance(self.decoder, CudaDecoder) or self.kv_cache.num_blocks <= self.block_manager.num_blocks:
            return False
        self.graphs = DecodeGraphs(self.decoder, self.model.compute_logits, self.kv_cache, max_num_seqs, max_model_len,
                                   dummy_block=self.block_manager.num_blocks, graph_type=graph_type)
        self.graphs.capture()
        return True

    def is_graph_step(self, output: SchedulerOutput) -> bool:
        """Whether ``output`` replays a decode graph: one token of every sequence, each its last
        (no prefill, no draft tokens), within the largest bucket."""
        return (self.graphs is not None and not output.draft_token_ids and 0 < len(output.seqs) <= self.graphs.max_batch
                and all(num == 1 for num in output.num_scheduled_tokens)
                and all(seq.num_computed_tokens + 1 == seq.num_tokens for seq in output.seqs))

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence's generator."""
        self._generators.pop(seq.seq_id, None)
        self._seeds.pop(seq.seq_id, None)

    def generator(self, seq: Sequence) -> torch.Generator:
        """``seq``'s own random generator (seeded from its request), made on first use."""
        if seq.seq_id not in self._generators:
            self._generators[seq.seq_id] = make_generator(seq.params.seed, self.model.device)
        return self._generators[seq.seq_id]

    def _keys(self, seqs: list[Sequence]) -> torch.Tensor:
        """[num_seqs, 2] int64 (seed, draw index) of each sequence's next draw from its keyed
        stream: its request's seed, or one drawn from fresh entropy when it has none."""
        rows = []
        for seq in seqs:
            if seq.seq_id not in self._seeds:
                seed = seq.params.seed
                self._seeds[seq.seq_id] = secrets.randbits(63) if seed is None else seed % (1 << 63)
            rows.append((self._seeds[seq.seq_id], seq.num_output_tokens))
        return torch.tensor(rows, dtype=torch.long).to(self.model.device, non_blocking=True)

    def prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, PagedAttentionMetadata, list[int],
                                                        list[Sequence]]:
        """(input ids [num_tokens], metadata, the flat rows that sample, the sequences that
        sample). A sequence samples from its last row, or with ``k`` draft tokens scheduled
        (``output.draft_token_ids``) from its last ``k + 1`` rows, which verify them."""
        spans, sample_rows, samplers = [], [], []
        num_rows = 0
        for seq, num in zip(output.seqs, output.num_scheduled_tokens):
            start = seq.num_computed_tokens
            draft_ids = output.draft_token_ids.get(seq.seq_id, [])
            token_ids = seq.token_ids[start:start + num - len(draft_ids)] + draft_ids
            spans.append(Span(token_ids, start, seq.block_table))
            num_rows += num
            if start + num - len(draft_ids) == seq.num_tokens:
                sample_rows.extend(range(num_rows - len(draft_ids) - 1, num_rows))
                samplers.append(seq)
        input_ids, meta = flat_batch(spans, self.block_manager.block_size, self.model.device)
        return input_ids, meta, sample_rows, samplers

    def logits(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, rows: list[int]) -> torch.Tensor | None:
        """fp32 logits [len(rows), vocab_size] of a flat batch's ``rows`` (None for no rows),
        after one pass that writes every token's key and value to the cache."""
        with batch_invariant(self.batch_invariant):
            if rows:
                return self.model.logits(input_ids, meta.positions, self.kv_cache, meta, rows, self.decoder)
            self.model(input_ids, meta.positions, self.kv_cache, meta, self.decoder)  # [num_tokens, hidden_size]
            return None

    @torch.inference_mode()
    def time_pass(self, num_seqs: int, context_len: int, repeats: int = 3, use_graphs: bool = False) -> float:
        """Median seconds of a pass of ``num_seqs`` one-token sequences, each after
        ``context_len`` cached tokens, every row computing logits: a decode step (the
        speculative cost model's calibration), eager, or with ``use_graphs`` through the decode
        graphs where they take it. Runs on blocks borrowed from the pool, which must have them free."""
        block_size = self.block_manager.block_size
        seqs = [Sequence([0] * (context_len + 1)) for _ in range(num_seqs)]
        for seq in seqs:
            if not self.block_manager.append_slots(seq, context_len + 1):
                for other in seqs:
                    self.block_manager.free(other)
                raise ValueError(f"the KV cache has too few free blocks to time {num_seqs} sequences")
        try:
            input_ids, meta = flat_batch([Span([0], context_len, seq.block_table) for seq in seqs], block_size,
                                         self.model.device)
            rows = list(range(num_seqs))
            is_graph = (use_graphs and self.graphs is not None and num_seqs <= self.graphs.max_batch
                        and context_len < self.graphs.max_model_len)
            times = []
            for _ in range(repeats + 1):  # the first pass warms up
                start = time.perf_counter()
                if is_graph:
                    self.graphs.run([0] * num_seqs, [context_len] * num_seqs, [seq.block_table for seq in seqs])
                else:
                    self.logits(input_ids, meta, rows)
                if self.model.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return statistics.median(times[1:])
        finally:
            for seq in seqs:
                self.block_manager.free(seq)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[int, list[int]]:
        """Run ``output``'s step; the new tokens of each sequence that sampled, by ``seq_id``:
        one token, or with draft tokens the accepted ones and a recovered or bonus token."""
        start = time.perf_counter()
        if self.is_graph_step(output):
            samplers = output.seqs
            logits = self.graphs.run([seq.token_ids[-1] for seq in samplers],
                                     [seq.num_computed_tokens for seq in samplers],
                                     [seq.block_table for seq in samplers])  # [num_seqs, vocab_size]
        else:
            input_ids, meta, sample_rows, samplers = self.prepare(output)
            logits = self.logits(input_ids, meta, sample_rows)  # [len(sample_rows), vocab_size]
        self.forward_seconds += time.perf_counter() - start
        self.last_logprobs = {}
        if logits is None:
            return {}
        start = time.perf_counter()
        new_token_ids: dict[int, list[int]] = {}
        if output.draft_token_ids:
            logits = self._verify(output, samplers, logits, new_token_ids)
            samplers = [seq for seq in samplers if seq.seq_id not in output.draft_token_ids]
        if samplers:
            for seq, token in zip(samplers, self._sample(samplers, logits)):
                new_token_ids[seq.seq_id] = [token]
        self.sample_seconds += time.perf_counter() - start
        return new_token_ids

    def _verify(self, output: SchedulerOutput, samplers: list[Sequence], logits: torch.Tensor,
                new_token_ids: dict[int, list[int]]) -> torch.Tensor:
        """Verify the drafting sequences' rows with the rejection sampler, filling
        ``new_token_ids``; the logits of the other samplers' rows, in order."""
        verify_rows, plain_rows = [], []
        cu_num_draft_tokens, drafting = [0], []
        row = 0
        for seq in samplers:
            num_draft = len(output.draft_token_ids.get(seq.seq_id, ()))
            if seq.seq_id in output.draft_token_ids:
                verify_rows.extend(range(row, row + num_draft + 1))
                cu_num_draft_tokens.append(cu_num_draft_tokens[-1] + num_draft)
                drafting.append(seq)
            else:
                plain_rows.append(row)
            row += num_draft + 1
        draft_ids = torch.tensor([t for seq in drafting for t in output.draft_token_ids[seq.seq_id]],
                                 dtype=torch.long, device=logits.device)  # [num_draft_tokens]
        # A draft on another device (a CPU draft beside a CUDA target) hands its rows over.
        draft_probs, draft_vocab_ids = (None if t is None else t.to(logits.device)
                                        for t in (output.draft_probs, output.draft_vocab_ids))
        params = [seq.params for seq in drafting]
        if self.keyed_sampling:  # every request at once, uniforms from the keyed streams
            result = rejection_sample_keyed(draft_ids, cu_num_draft_tokens, logits[verify_rows], params,
                                            self._keys(drafting), draft_probs, draft_vocab_ids)
        else:
            result = rejection_sample_batch(draft_ids, cu_num_draft_tokens, logits[verify_rows], params,
                                            [self.generator(seq) for seq in drafting], draft_probs, draft_vocab_ids)
        for seq, tokens in zip(drafting, result.output_token_ids):
            new_token_ids[seq.seq_id] = tokens
        return logits[plain_rows]

    def _sample(self, samplers: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token for each sequence from its logits row, with its own parameters."""
        # logits: [num_sampling_seqs, vocab_size]
        processed = logits  # copied when a row's penalties, bias or min_tokens apply
        rows = [i for i, seq in enumerate(samplers) if changes_logits(seq.params)]
        if rows:
            seqs = [samplers[i] for i in rows]
            processed = logits.clone()
            processed[rows] = apply_extras(logits[rows], [seq.params for seq in seqs],
                                           [seq.prompt_token_ids for seq in seqs], [seq.output_token_ids for seq in seqs],
                                           sorted(self.eos_token_ids))
        constrained = self.structured.constrained(samplers) if self.structured is not None else []
        if constrained:
            # Masked in place; copied first only where a masked row reports its model's logprobs.
            if processed is logits and any(samplers[i].params.logprobs is not None for i in constrained):
                processed = logits.clone()
            self.structured.mask(samplers, processed, constrained)
        params = [seq.params for seq in samplers]
        if not self.keyed_sampling:
            token_ids = sample_batch(processed, params, [self.generator(seq) for seq in samplers])
        elif all(p.is_greedy for p in params):
            token_ids = sample_batch(processed, params, [None] * len(samplers))
        else:
            token_ids = sample_batch(processed, params, keys=self._keys(samplers))
        token_ids = token_ids.tolist()  # [num_sampling_seqs]
        for i, (seq, token) in enumerate(zip(samplers, token_ids)):
            num_top = seq.params.logprobs
            if num_top is not None:
                # Of the model's own distribution, before penalties and temperature (as vLLM reports them).
                logprobs = torch.log_softmax(logits[i], dim=-1)  # [vocab_size]
                top = torch.topk(logprobs, num_top) if num_top else None
                pairs = [] if top is None else [(int(t), float(v)) for v, t in zip(top.values, top.indices)]
                self.last_logprobs[seq.seq_id] = (float(logprobs[token]), pairs)
        return token_ids
