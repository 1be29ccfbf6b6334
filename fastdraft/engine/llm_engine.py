"""The serving engine: requests in, one scheduled step at a time, text out.

``add_request`` queues a prompt; each ``step`` asks the scheduler which sequences compute how
many tokens, runs them as one flat batch (``ModelRunner``), records the sampled tokens, and
returns what each request produced in that step (a :class:`~fastdraft.engine.output.RequestDelta`:
new tokens and text, and the finish reason once it ends).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.loader import describe_weights
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.output import RequestCollector, RequestDelta, RequestOutput
from fastdraft.engine.request import check_request
from fastdraft.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from fastdraft.engine.sequence import Sequence, SequenceStatus
from fastdraft.engine.speculation import Speculator, SpeculatorFactory, may_speculate
from fastdraft.engine.structured import StructuredOutputs, check_constraint
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.models.files import LoadedModel
from fastdraft.sampling_params import SamplingParams
from fastdraft.tokenizer import IncrementalDetokenizer, StopStringMatcher

logger = logging.getLogger(__name__)

# Share of the memory available at start-up the KV cache takes when no size is given.
KV_CACHE_MEMORY_FRACTION = 0.25


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@dataclass
class EngineConfig:
    """How the engine sizes its cache and its steps; checked with ``ValueError``.

    ``kv_cache_memory`` (GiB) sizes the block pool; by default it is ``KV_CACHE_MEMORY_FRACTION``
    of the available memory, capped at what ``max_num_seqs`` sequences of ``max_model_len``
    tokens could use. ``num_blocks`` sets the pool's size directly instead.

    ``block_size`` is best a power of two: the C++ attention and decoder need one (other sizes
    run the PyTorch path). ``batch_invariant`` runs every step in :func:`fastdraft.kernels.mode.batch_invariant`: a
    sequence's logits, bit for bit, do not depend on what else runs, on how its prompt was
    chunked, on preemption or on the prefix cache (see docs/architecture.md for its cost).

    On a GPU, pure-decode steps replay CUDA graphs captured at start-up (``engine/cuda_graphs.py``);
    ``enforce_eager`` (vLLM's name) runs every step eagerly instead."""

    block_size: int = 16
    kv_cache_memory: float | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    batch_invariant: bool = True
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_model_len < 1:
            raise ValueError("block_size and max_model_len must be positive")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be at least max_model_len: a "
                             "sequence recomputed after a preemption runs in one step")

    def pool_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        """Blocks in the pool; ``max_model_len``: the longest sequence the model allows here."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory is not None:
            budget = int(self.kv_cache_memory * (1 << 30))
        else:
            budget = int(available_memory_bytes() * KV_CACHE_MEMORY_FRACTION)
            budget = min(budget, self.max_num_seqs * -(-max_model_len // self.block_size) * bytes_per_block)
        num = budget // bytes_per_block
        if num < 1:
            raise ValueError(f"kv_cache_memory holds no block of {bytes_per_block} bytes")
        return num


class _Request:
    """The engine's side of a request: its sequence, and what turns its tokens into deltas."""

    def __init__(self, seq: Sequence, prompt: str | None, detokenizer: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.stop = StopStringMatcher(list(seq.params.stop))
        self.arrival = time.perf_counter()
        self.last_token_time = self.arrival
        self.num_sent = 0  # generated tokens already handed out in deltas


class LLMEngine:
    """Continuous batching over a paged KV cache for one model.

    ``speculation`` (``fastdraft.speculative.factory.speculator_factory(config)``) makes the
    speculator with which decoding requests draft tokens and verify them in the engine's steps
    (``engine/speculation.py``)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 speculation: SpeculatorFactory | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model = loaded.model
        self.vocab_size = loaded.config.vocab_size
        self.weights = describe_weights(loaded.model)  # which weights run, for /v1/models
        self.max_model_len = min(self.config.max_model_len, loaded.config.max_position_embeddings)
        num_blocks = self.config.pool_blocks(PagedKVCache.bytes_per_block(loaded.config, self.config.block_size,
                                                                          model.dtype), self.max_model_len)
        # On a GPU, one block past the block manager's: the decode graphs' padding rows read it.
        use_graphs = model.device.type == "cuda" and not self.config.enforce_eager
        # Local-attention layers give back the blocks their window has passed (CPU memory only).
        windows = {i: layer.attention.sliding_window for i, layer in enumerate(model.plan.layers)
                   if layer.attention.sliding_window is not None and model.device.type == "cpu"}
        self.kv_cache = PagedKVCache.from_config(loaded.config, num_blocks + use_graphs, self.config.block_size,
                                                 model.dtype, model.device, windowed_layers=tuple(windows))
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.config.block_size,
                    self.kv_cache.num_bytes / (1 << 30))
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                                          window=max(windows.values(), default=None),
                                          on_window_passed=self.kv_cache.release_window_blocks)
        eos_token_ids = set(loaded.config.eos_token_ids or [])
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.config.enable_chunked_prefill), self.block_manager,
                                   eos_token_ids)
        self.runner = ModelRunner(model, self.kv_cache, self.block_manager, eos_token_ids,
                                  batch_invariant=self.config.batch_invariant)
        if use_graphs and not self.runner.capture_graphs(self.config.max_num_seqs, self.max_model_len):
            logger.info("decode steps run eagerly: the model runs the module path on this GPU")
        self.speculator: Speculator | None = None
        if speculation is not None:
            self.speculator = speculation(loaded, self.runner, self.config.max_num_seqs)
        self._requests: dict[str, _Request] = {}
        self._streams: dict[str, deque[RequestDelta]] = {}  # deltas waiting for outputs()'s reader
        # Constrained requests wait in _compiling until their grammars are compiled; the
        # tokenizer's grammar view starts building now, off this thread.
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, sorted(eos_token_ids))
        self.runner.structured = self.structured
        self._compiling: list[Sequence] = []
        self._ids = itertools.count()

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._compiling)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue ``prompt`` (text, or token ids); returns its request id. ``ValueError`` for a
        request that cannot run (:func:`~fastdraft.engine.request.check_request`; a duplicate
        id; more cache than the pool holds)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            prompt_ids, text = prompt, None
        check_request(prompt_ids, params, self.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(prompt_ids, params, request_id=request_id)
        if params.structured_outputs is None:
            self.scheduler.add(seq)
        else:  # joins the scheduler when its grammar is compiled (off the step loop)
            self.structured.submit(params.structured_outputs)
            self.scheduler.check_fits(seq)
            self._compiling.append(seq)
        self._requests[request_id] = _Request(seq, text, IncrementalDetokenizer(self.tokenizer))
        return request_id

    def collector(self, request_id: str) -> RequestCollector:
        """A collector for an unfinished request's deltas, knowing its prompt."""
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"no unfinished request {request_id!r}")
        return RequestCollector(request_id, request.seq.prompt_token_ids, request.prompt)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        self._streams.pop(request_id, None)
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.seq in self._compiling:
            self._compiling.remove(request.seq)
        self.scheduler.abort(request_id)
        self._release(request.seq)
        return True

    def _release(self, seq: Sequence) -> None:
        self.runner.release(seq)
        self.structured.release(seq)
        if self.speculator is not None:
            self.speculator.policy.release(seq)
            self.speculator.proposer.release(seq)

    def _admit_compiled(self) -> list[RequestDelta]:
        """Queue the constrained sequences whose grammars are ready, in arrival order; a final
        delta (``finish_reason`` "abort") for each whose grammar failed to compile."""
        failed = []
        for seq in list(self._compiling):
            try:
                if not self.structured.is_ready(seq):
                    continue
            except Exception:  # the library's own error type varies; the request ends, the engine goes on
                logger.exception("request %s: its grammar failed to compile", seq.request_id)
                self._compiling.remove(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self._release(seq)
                request = self._requests.pop(seq.request_id)
                failed.append(self._emit(request, time.perf_counter()))
                continue
            self._compiling.remove(seq)
            self.scheduler.add(seq)
        return failed

    def step(self) -> list[RequestDelta]:
        """Run one scheduled step; a delta for each request that produced tokens in it."""
        failed = self._admit_compiled() if self._compiling else []
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.scheduler.has_unfinished:
                raise RuntimeError("no request could be scheduled: the KV cache is too small for the next one")
            if self._compiling:
                time.sleep(0.001)  # only grammars compiling: wait for them, not in a busy loop
            return self._hand_out(failed)
        plain = self._speculate(output) if self.speculator is not None else set()
        sampled = self.runner.execute(output)
        self.scheduler.update(output, sampled)
        if self.structured.is_active:
            for seq in output.seqs:
                # A grammar completed without its stop token (ignore_eos) ends the request here.
                if seq.seq_id in sampled and self.structured.accept(seq, sampled[seq.seq_id]) \
                        and not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
        now = time.perf_counter()
        deltas = failed
        for seq in output.seqs:
            if seq.seq_id not in sampled:
                continue
            request = self._requests[seq.request_id]
            delta = self._emit(request, now)
            if seq.seq_id in plain or seq.seq_id in output.draft_token_ids:
                num_draft = len(output.draft_token_ids.get(seq.seq_id, ()))
                delta.num_draft_tokens = num_draft
                delta.num_accepted_tokens = len(sampled[seq.seq_id]) - 1 if num_draft else 0
                if not seq.is_finished:
                    self.speculator.policy.update(seq, num_draft, delta.num_accepted_tokens)
                    self.speculator.proposer.update(seq, num_draft, delta.num_accepted_tokens)
            if seq.is_finished:
                self._release(seq)
                del self._requests[seq.request_id]
            deltas.append(delta)
        return self._hand_out(deltas)

    def _hand_out(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """``deltas``, kept too for the readers of ``outputs()`` that wait on them."""
        for delta in deltas:
            if delta.request_id in self._streams:
                self._streams[delta.request_id].append(delta)
        return deltas

    def _speculate(self, output: SchedulerOutput) -> set[int]:
        """Add draft tokens to ``output``'s decoding sequences where the policy finds it
        pays; the ids of the sequences that could have drafted but decode plainly."""
        candidates = [i for i, (seq, num) in enumerate(zip(output.seqs, output.num_scheduled_tokens))
                      if num == 1 and seq.status is SequenceStatus.RUNNING
                      and seq.num_computed_tokens + 1 == seq.num_tokens and may_speculate(seq.params)]
        if not candidates:
            return set()
        seqs = [output.seqs[i] for i in candidates]
        lengths = self.speculator.policy.draft_lengths(seqs, output.num_tokens)
        drafting, num_tokens, plain = [], [], set()
        for i, seq, k in zip(candidates, seqs, lengths):
            # No drafts past max_new_tokens or the model's length (the last token verifies them).
            k = min(k, seq.params.max_new_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if k > 0 and self.scheduler.reserve_draft_slots(output, i, k):
                drafting.append(i)
                num_tokens.append(k)
            else:
                plain.add(seq.seq_id)
        if not drafting:
            return plain
        batch = self.speculator.proposer.propose([output.seqs[i] for i in drafting], num_tokens,
                                                 [self.runner.generator(output.seqs[i]) for i in drafting])
        for i, k, draft_ids in zip(drafting, num_tokens, batch.draft_token_ids):
            output.num_scheduled_tokens[i] -= k - len(draft_ids)  # the proposer found fewer
            if draft_ids:
                output.draft_token_ids[output.seqs[i].seq_id] = list(draft_ids)
            else:
                plain.add(output.seqs[i].seq_id)
        output.draft_probs, output.draft_vocab_ids = batch.draft_probs, batch.draft_vocab_ids
        return plain

    def _emit(self, request: _Request, now: float) -> RequestDelta:
        """The delta of ``request``'s tokens new since its last one: their text, held back
        while it may begin a stop string. A stop string found in the text finishes the
        sequence there (the token that completed it is the last one kept)."""
        seq = request.seq
        new_ids = seq.token_ids[seq.num_prompt_tokens + request.num_sent:]
        # A sequence ended by EOS (the scheduler's call) ends its text before that token.
        num_text = len(new_ids) - (seq.finish_reason == "stop" and isinstance(seq.stop_reason, int))
        if not seq.params.detokenize:
            num_text = 0
        text = ""
        for i in range(num_text):
            text += request.stop.feed(request.detokenizer.add(new_ids[i]))
            if request.stop.is_stopped:
                new_ids = new_ids[:i + 1]
                self.scheduler.finish(seq, "stop", num_kept=request.num_sent + len(new_ids),
                                      stop_reason=request.stop.matched)
                break
        if seq.is_finished and not request.stop.is_stopped:
            text += request.stop.flush()
        request.num_sent += len(new_ids)
        logprobs = self.runner.last_logprobs.get(seq.seq_id)
        delta = RequestDelta(seq.request_id, new_ids, text, None if logprobs is None else [logprobs],
                             seq.finish_reason if seq.is_finished else None)
        # Tokens verified together arrive together; each gets its share of the gap.
        delta.token_gap_s = (now - request.last_token_time) / max(len(new_ids), 1)
        if request.num_sent == len(new_ids):
            delta.ttft_s = now - request.arrival
            delta.num_cached_tokens = seq.num_cached_tokens
        request.last_token_time = now
        return delta

    def abort_all(self) -> None:
        """Abort every unfinished request."""
        for request_id in list(self._requests):
            self.abort_request(request_id)

    def outputs(self, request_id: str) -> Iterator[RequestDelta]:
        """An added request's deltas, kept from this call on until read: iterating yields them
        as they come, stepping the engine while none is waiting. Other requests advance in the
        same steps, and several streams may be read in turn. Ends when the request finishes or
        is aborted; closing the iterator before then aborts the request."""
        if request_id not in self._requests:
            raise ValueError(f"no unfinished request {request_id!r}")
        queue = self._streams[request_id] = deque()
        return self._read(request_id, queue)

    def _read(self, request_id: str, queue: deque[RequestDelta]) -> Iterator[RequestDelta]:
        try:
            while True:
                while not queue:
                    if request_id not in self._requests:
                        return  # aborted
                    self.step()
                delta = queue.popleft()
                yield delta
                if delta.is_finished:
                    return
        finally:
            self.abort_request(request_id)  # a no-op once it has finished


@torch.inference_mode()
def run_to_completion(engine: LLMEngine, prompts: list[str | list[int]], params: list[SamplingParams],
                      progress=None) -> list[RequestOutput]:
    """Queue every prompt, step until all are done; outputs in prompt order. ``progress`` (a
    tqdm bar, say) is advanced once per finished request."""
    collectors: dict[str, RequestCollector] = {}
    try:
        for prompt, p in zip(prompts, params):
            request_id = engine.add_request(prompt, p)
            collectors[request_id] = engine.collector(request_id)
    except ValueError:
        for request_id in collectors:  # nothing of a refused batch stays queued
            engine.abort_request(request_id)
        raise
    num_finished = 0
    while num_finished < len(collectors):
        for delta in engine.step():
            collector = collectors[delta.request_id]
            collector.add(delta)
            if collector.is_finished:
                num_finished += 1
                if progress is not None:
                    progress.update(1)
    return [collector.output() for collector in collectors.values()]
