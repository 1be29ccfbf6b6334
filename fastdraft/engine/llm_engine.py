"""The serving engine: requests in, one scheduled step at a time, text out.

``add_request`` queues a prompt; each ``step`` asks the scheduler which sequences compute how
many tokens, runs them as one flat batch (``ModelRunner``), records the sampled tokens, and
returns what every request produced in that step: new text, and whether it finished.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.metrics import GenerationMetrics, SpecMetrics
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from fastdraft.engine.sequence import Sequence, SequenceStatus
from fastdraft.engine.speculation import Speculation, Speculator, may_speculate
from fastdraft.layers.kv_cache import PagedKVCache
from fastdraft.models.loader import LoadedModel
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
    chunked, on preemption or on the prefix cache (see docs/architecture.md for its cost)."""

    block_size: int = 16
    kv_cache_memory: float | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    batch_invariant: bool = True

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


@dataclass
class RequestOutput:
    """What a request has produced so far; ``new_text`` and ``new_token_ids`` are this step's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    is_finished: bool = False
    finish_reason: str | None = None
    metrics: GenerationMetrics = field(default_factory=GenerationMetrics)
    # With SamplingParams.logprobs: per generated token, (its log-probability, the top ones as
    # [(token id, log-probability)]), from the model's distribution before any sampling option.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class _Request:
    def __init__(self, seq: Sequence, prompt: str | None, detokenizer: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.output = RequestOutput(seq.request_id, prompt, list(seq.prompt_token_ids))
        self.output.metrics.num_prompt_tokens = seq.num_prompt_tokens
        self.detokenizer = detokenizer
        self.stop = StopStringMatcher(list(seq.params.stop))
        self.arrival = time.perf_counter()
        self.last_token_time = self.arrival


class LLMEngine:
    """Continuous batching over a paged KV cache for one model.

    With ``speculation`` (a :class:`~fastdraft.spec.config.SpeculativeConfig`), decoding
    requests draft tokens and verify them in the engine's steps (``engine/speculation.py``);
    ``draft``: an already loaded draft model for it to use."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 speculation: Speculation | None = None, draft: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model = loaded.model
        self.max_model_len = min(self.config.max_model_len, loaded.config.max_position_embeddings)
        num_blocks = self.config.pool_blocks(PagedKVCache.bytes_per_block(loaded.config, self.config.block_size,
                                                                          model.dtype), self.max_model_len)
        self.kv_cache = PagedKVCache.from_config(loaded.config, num_blocks, self.config.block_size, model.dtype,
                                                 model.device)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.config.block_size,
                    self.kv_cache.num_bytes / (1 << 30))
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.config.enable_chunked_prefill), self.block_manager)
        self.eos_token_ids = set(loaded.config.eos_token_ids or [])
        self.runner = ModelRunner(model, self.kv_cache, self.block_manager, self.eos_token_ids,
                                  batch_invariant=self.config.batch_invariant)
        self.speculator: Speculator | None = None
        if speculation is not None:
            self.speculator = speculation.start(loaded, self.runner, self.config.max_num_seqs, draft)
        self._requests: dict[str, _Request] = {}
        self._streams: dict[str, deque[RequestOutput]] = {}  # outputs waiting for generate()'s reader
        self._ids = itertools.count()

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue ``prompt`` (text, or token ids); returns its request id. ``ValueError`` for a
        request that cannot run: empty, longer than ``max_model_len``, a duplicate id."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab_size = self.loaded.config.vocab_size
            if not all(0 <= t < vocab_size for t in prompt):
                raise ValueError(f"prompt token ids must be in [0, {vocab_size}), the model's vocabulary")
            prompt_ids, text = list(prompt), None
        else:
            raise ValueError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(t >= self.loaded.config.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.loaded.config.vocab_size}), the model's "
                             "vocabulary")
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"the maximum model length {self.max_model_len}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(prompt_ids, params, request_id=request_id)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq, text, IncrementalDetokenizer(self.tokenizer))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        request = self._requests.pop(request_id, None)
        if seq is None or request is None:
            return False
        self._release(seq)
        return True

    def _release(self, seq: Sequence) -> None:
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; the outputs of the requests that produced a token in it."""
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.scheduler.has_unfinished:
                raise RuntimeError("no request could be scheduled: the KV cache is too small for the next one")
            return []
        plain = self._speculate(output) if self.speculator is not None else []
        sampled = self.runner.execute(output)
        self.scheduler.update(output, sampled, self.eos_token_ids)
        if self.speculator is not None:
            self._record_speculation(output, sampled, plain)
        now = time.perf_counter()
        results = []
        for seq in output.seqs:
            if seq.seq_id not in sampled:
                continue
            out = self._record(self._requests[seq.request_id], sampled[seq.seq_id], now,
                               self.runner.last_logprobs.get(seq.seq_id))
            results.append(out)
            if out.request_id in self._streams:
                self._streams[out.request_id].append(out)
        return results

    def _speculate(self, output: SchedulerOutput) -> list[Sequence]:
        """Add draft tokens to ``output``'s decoding sequences where the speculator finds it
        pays; the sequences that could have drafted but decode plainly."""
        candidates = [i for i, (seq, num) in enumerate(zip(output.seqs, output.num_scheduled_tokens))
                      if num == 1 and seq.status is SequenceStatus.RUNNING
                      and seq.num_computed_tokens + 1 == seq.num_tokens and may_speculate(seq.params)]
        if not candidates:
            return []
        seqs = [output.seqs[i] for i in candidates]
        lengths = self.speculator.draft_lengths(seqs, output.num_tokens)
        drafting, num_tokens, plain = [], [], []
        for i, seq, k in zip(candidates, seqs, lengths):
            # No drafts past max_new_tokens or the model's length (the last token verifies them).
            k = min(k, seq.params.max_new_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k > 0 and self.scheduler.reserve_draft_slots(output, i, k):
                drafting.append(i)
                num_tokens.append(k)
            else:
                plain.append(seq)
        if not drafting:
            return plain
        batch = self.speculator.propose([output.seqs[i] for i in drafting], num_tokens,
                                        [self.runner.generator(output.seqs[i]) for i in drafting])
        for i, k, draft_ids in zip(drafting, num_tokens, batch.draft_token_ids):
            output.num_scheduled_tokens[i] -= k - len(draft_ids)  # the proposer found fewer
            if draft_ids:
                output.draft_token_ids[output.seqs[i].seq_id] = list(draft_ids)
            else:
                plain.append(output.seqs[i])
        output.draft_probs, output.draft_vocab_ids = batch.draft_probs, batch.draft_vocab_ids
        return plain

    def _record_speculation(self, output: SchedulerOutput, sampled: dict[int, list[int]],
                            plain: list[Sequence]) -> None:
        """Tell the speculator, and each request's metrics, what the step's drafts came to."""
        outcomes = [(seq, 0, 0) for seq in plain]
        outcomes += [(seq, len(output.draft_token_ids[seq.seq_id]), len(sampled[seq.seq_id]) - 1)
                     for seq in output.seqs if seq.seq_id in output.draft_token_ids]
        for seq, num_draft, num_accepted in outcomes:
            request = self._requests[seq.request_id]
            spec = request.output.metrics.spec
            if spec is None:
                spec = request.output.metrics.spec = SpecMetrics()
            # Emitted: what the sequence kept, up to EOS or its length limit.
            num_emitted = len(seq.output_token_ids) - request.output.metrics.num_generated_tokens
            spec.record(num_draft, num_accepted, num_emitted)
            if not seq.is_finished:
                self.speculator.update(seq, num_draft, num_accepted)

    def _record(self, request: _Request, token_ids: list[int], now: float,
                logprobs: tuple[float, list[tuple[int, float]]] | None) -> RequestOutput:
        seq, out = request.seq, request.output
        token_ids = token_ids[:len(seq.output_token_ids) - len(out.token_ids)]  # past EOS or the length limit
        if logprobs is not None:
            out.logprobs = (out.logprobs or []) + [logprobs]
        metrics = out.metrics
        # Tokens verified together arrive together; each gets its share of the gap.
        gap = (now - request.last_token_time) / len(token_ids)
        if metrics.num_generated_tokens == 0:
            metrics.ttft_s = now - request.arrival
            metrics.token_latencies_s.extend([gap] * (len(token_ids) - 1))
        else:
            metrics.token_latencies_s.extend([gap] * len(token_ids))
        request.last_token_time = now
        out.new_token_ids = []
        piece = ""
        for token in token_ids:
            metrics.num_generated_tokens += 1
            out.token_ids.append(token)
            out.new_token_ids.append(token)
            is_eos = token in self.eos_token_ids and not seq.params.ignore_eos
            piece += "" if is_eos else request.stop.feed(request.detokenizer.add(token))
            if request.stop.is_stopped:
                if seq.is_finished:
                    seq.finish_reason = "stop"  # the text ends at the stop string, whatever else ended it
                else:
                    self.scheduler.finish(seq, "stop")
                del seq.output_token_ids[len(out.token_ids):]  # tokens verified past the stop string
                break
        if seq.is_finished:
            piece += request.stop.flush() if not request.stop.is_stopped else ""
            out.is_finished, out.finish_reason = True, seq.finish_reason
            metrics.finish_reason = seq.finish_reason
            self._release(seq)
            del self._requests[seq.request_id]
        out.new_text = piece
        out.text += piece
        # A snapshot: the request's record keeps growing after this step.
        return replace(out, token_ids=list(out.token_ids), new_token_ids=list(out.new_token_ids),
                       logprobs=None if out.logprobs is None else list(out.logprobs),
                       metrics=replace(metrics, token_latencies_s=list(metrics.token_latencies_s)))

    def abort_all(self, except_request_id: str | None = None) -> None:
        """Abort every unfinished request (but ``except_request_id``)."""
        for request_id in list(self._requests):
            if request_id != except_request_id:
                self.abort_request(request_id)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Add one request and yield its outputs as they come (``outputs``). The request is
        added, and checked, when iteration starts."""
        yield from self.outputs(self.add_request(prompt, params))

    def outputs(self, request_id: str) -> Iterator[RequestOutput]:
        """Yield an added request's outputs as they come, stepping the engine while none is
        waiting; other requests advance in the same steps, and several streams may be read in
        turn. Ends when the request finishes or is aborted; closing the iterator before then
        aborts the request."""
        if request_id not in self._requests:
            raise ValueError(f"no unfinished request {request_id!r}")
        queue = self._streams[request_id] = deque()
        try:
            while True:
                while not queue:
                    if request_id not in self._requests:
                        return  # aborted
                    self.step()
                out = queue.popleft()
                yield out
                if out.is_finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self.abort_request(request_id)  # a no-op once it has finished


@torch.inference_mode()
def run_to_completion(engine: LLMEngine, prompts: list[str | list[int]], params: list[SamplingParams],
                      progress=None) -> list[RequestOutput]:
    """Queue every prompt, step until all are done; outputs in prompt order. ``progress`` (a
    tqdm bar, say) is advanced once per finished request."""
    ids: list[str] = []
    try:
        for prompt, p in zip(prompts, params):
            ids.append(engine.add_request(prompt, p))
    except ValueError:
        for request_id in ids:  # nothing of a refused batch stays queued
            engine.abort_request(request_id)
        raise
    finished: dict[str, RequestOutput] = {}
    while len(finished) < len(ids):
        for out in engine.step():
            if out.is_finished:
                finished[out.request_id] = out
                if progress is not None:
                    progress.update(1)
    return [finished[i] for i in ids]
