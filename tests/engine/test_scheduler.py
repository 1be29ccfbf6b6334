"""Paged-cache bookkeeping and scheduling: blocks, prefix caching, chunked prefill, preemption.

The scheduler is driven by a stand-in model whose next token is a function of the whole token
history, so any bookkeeping slip (a lost token, a recomputation from the wrong place) changes
the output; a run with preemption and chunking must produce what an unhurried run produces.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from fastdraft.engine.block_manager import BlockManager, block_hash
from fastdraft.engine.model_runner import Span, flat_batch
from fastdraft.engine.scheduler import Scheduler, SchedulerConfig
from fastdraft.engine.sequence import Sequence, SequenceStatus
from fastdraft.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def seq_of(tokens, max_new_tokens=8, request_id=None, ignore_eos=True) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
                    request_id=request_id)


def next_token(history: list[int]) -> int:
    digest = hashlib.sha256(bytes(t % 256 for t in history)).digest()
    return 1 + digest[0] % (VOCAB - 1)


def run(scheduler: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> dict[str, list[int]]:
    """Drive ``scheduler`` to completion; checks each step's bookkeeping on the way."""
    for seq in seqs:
        scheduler.add(seq)
    bm = scheduler.block_manager
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            break
        out = scheduler.schedule()
        assert out.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        sampled = {}
        for seq, num in zip(out.seqs, out.num_scheduled_tokens):
            assert num >= 1
            # Every token this step computes has a slot in the sequence's blocks.
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + num
            if seq.num_computed_tokens + num == seq.num_tokens:
                sampled[seq.seq_id] = [next_token(seq.token_ids)]
        scheduler.update(out, sampled)
    else:
        pytest.fail("the scheduler did not finish")
    assert all(b.ref_count == 0 for b in bm.blocks), "blocks still held after every request ended"
    assert bm.num_free_blocks == bm.num_blocks
    return {seq.request_id: seq.output_token_ids for seq in seqs}


def reference_outputs(seqs: list[Sequence]) -> dict[str, list[int]]:
    result = {}
    for seq in seqs:
        tokens, out = list(seq.prompt_token_ids), []
        for _ in range(seq.params.max_new_tokens):
            out.append(next_token(tokens))
            tokens.append(out[-1])
        result[seq.request_id] = out
    return result


def prompts(num: int, length: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, VOCAB) for _ in range(length - shared_prefix)] for _ in range(num)]


# --- block manager ---------------------------------------------------------------------------


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = seq_of(range(1, 11))  # 10 tokens: 3 blocks
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert len(set(seq.block_table)) == 3
    _, meta = flat_batch([Span([0], 5, seq.block_table)], bm.block_size, torch.device("cpu"))
    assert meta.slot_mapping.tolist() == [seq.block_table[1] * 4 + 1]  # position 5: block 1, offset 1
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_append_slots_grows_one_block_at_a_time_and_refuses_when_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = seq_of([1, 2, 3, 4])
    bm.allocate(seq, 4)
    seq.num_computed_tokens = 4
    assert bm.append_slots(seq, 1) and len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    assert not bm.append_slots(seq, 1)  # no third block
    assert len(seq.block_table) == 2


def test_prefix_hits_share_blocks_and_count_references():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq_of([5, 6, 7, 8, 9, 10, 11, 12, 13])
    bm.allocate(first, 9)
    first.num_computed_tokens = 9
    bm.commit(first)  # two full blocks keyed
    second = seq_of([5, 6, 7, 8, 9, 10, 11, 12, 40, 41])
    bm.allocate(second, 2)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [2, 2]
    assert bm.num_prefix_hits == 8 and bm.num_prefix_queries == 9 + 10
    bm.free(first)
    bm.free(second)
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_a_fully_cached_prompt_computes_its_last_token_in_a_block_of_its_own():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.commit(first)
    again = seq_of([1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(again, 4)
    # The second block holds the last token, which is computed again for its logits: it must
    # not be written into the block the first sequence is reading.
    assert again.block_table[0] == first.block_table[0] and again.block_table[1] != first.block_table[1]
    assert again.num_computed_tokens == 4 and again.num_uncomputed_tokens == 4


def test_freed_prefixes_survive_until_their_blocks_are_needed():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = seq_of([1, 2, 3, 4])
    bm.allocate(old, 4)
    old.num_computed_tokens = 4
    bm.commit(old)
    table = list(old.block_table)
    bm.free(old)
    assert len(bm.cached_prefix_blocks(seq_of([1, 2, 3, 4, 9]))) == 2  # still cached while free
    filler = seq_of([7, 7, 7, 7, 7, 7])  # takes three of the four blocks
    bm.allocate(filler, 6)
    # The old sequence's last block went back to the pool first, so it was evicted first; its
    # first block, the shorter prefix others are likelier to share, is still found.
    hits = bm.cached_prefix_blocks(seq_of([1, 2, 3, 4, 9]))
    assert [b.block_id for b in hits] == table[:1]


def test_block_keys_name_the_whole_prefix():
    a = block_hash(block_hash(b"", [1, 2]), [3, 4])
    b = block_hash(block_hash(b"", [9, 9]), [3, 4])
    assert a != b and a == block_hash(block_hash(b"", [1, 2]), [3, 4])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    scheduler = Scheduler(SchedulerConfig(), BlockManager(num_blocks=2, block_size=4), {EOS})
    with pytest.raises(ValueError, match="cache blocks"):
        scheduler.add(seq_of(range(1, 10), max_new_tokens=4))  # 13 tokens > 8 slots


# --- scheduler -------------------------------------------------------------------------------


def test_unhurried_run_matches_the_reference():
    seqs = [seq_of(p, request_id=str(i)) for i, p in enumerate(prompts(4, 12))]
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256), BlockManager(64, 4), {EOS})
    assert run(scheduler, seqs) == reference_outputs(seqs)


def test_chunked_prefill_interleaves_with_decodes():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), BlockManager(64, 4), {EOS})
    short = seq_of([1, 2, 3], max_new_tokens=20, request_id="short")
    scheduler.add(short)
    out = scheduler.schedule()
    scheduler.update(out, {short.seq_id: [next_token(short.token_ids)]})
    long = seq_of(list(range(1, 41)), max_new_tokens=4, request_id="long")  # 40 tokens: 5+ chunks
    scheduler.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = scheduler.schedule()
        assert out.seqs[0] is short and out.num_scheduled_tokens[0] == 1  # the decode goes first
        chunks.append(dict(zip([s.request_id for s in out.seqs], out.num_scheduled_tokens))["long"])
        sampled = {s.seq_id: [next_token(s.token_ids)] for s, n in zip(out.seqs, out.num_scheduled_tokens)
                   if s.num_computed_tokens + n == s.num_tokens}
        scheduler.update(out, sampled)
    assert chunks == [7, 7, 7, 7, 7, 5] and len(short.output_token_ids) == 7


def test_without_chunking_a_request_must_fit_one_step():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=14, enable_chunked_prefill=False),
                          BlockManager(64, 4), {EOS})
    with pytest.raises(ValueError, match="chunked prefill is off"):
        scheduler.add(seq_of(list(range(1, 13)), max_new_tokens=8))  # may reach 19 tokens to recompute
    scheduler.add(seq_of(list(range(1, 13)), max_new_tokens=2))
    short = seq_of([1, 2, 3], max_new_tokens=4)
    scheduler.add(short)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [12]  # the short one waits for the budget left
    assert short.status is SequenceStatus.WAITING


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_when_the_pool_runs_out_leaves_the_output_unchanged(chunked):
    # 6 sequences of 12 prompt + 16 new tokens need 6 * 7 blocks of 4; the pool has 16.
    seqs = [seq_of(p, max_new_tokens=16, request_id=str(i)) for i, p in enumerate(prompts(6, 12, seed=1))]
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, enable_chunked_prefill=chunked),
                          BlockManager(16, 4), {EOS})
    assert run(scheduler, seqs) == reference_outputs(seqs)
    assert scheduler.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "length" for s in seqs)


def test_shared_prefixes_are_computed_once():
    seqs = [seq_of(p, max_new_tokens=4, request_id=str(i)) for i, p in enumerate(prompts(5, 20, seed=2,
                                                                                         shared_prefix=16))]
    bm = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, {EOS})
    scheduler.add(seqs[0])
    computed = 0
    first = scheduler.schedule()
    computed += first.num_tokens
    scheduler.update(first, {seqs[0].seq_id: [next_token(seqs[0].token_ids)]})
    outputs = run(scheduler, seqs[1:])
    assert outputs == {k: v for k, v in reference_outputs(seqs[1:]).items()}
    assert bm.num_prefix_hits == 4 * 16  # each later prompt found the 16 shared tokens
    assert computed == 20


def test_prefix_caching_off_computes_everything():
    seqs = [seq_of(p, max_new_tokens=2, request_id=str(i)) for i, p in enumerate(prompts(3, 12, shared_prefix=8))]
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    assert run(Scheduler(SchedulerConfig(), bm, {EOS}), seqs) == reference_outputs(seqs)
    assert bm.num_prefix_hits == 0


def test_eos_finishes_a_request_and_abort_frees_its_blocks():
    bm = BlockManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(), bm, {EOS})
    stopper = seq_of([1, 2, 3], max_new_tokens=10, request_id="stop", ignore_eos=False)
    other = seq_of([4, 5, 6], max_new_tokens=10, request_id="other")
    scheduler.add(stopper)
    scheduler.add(other)
    out = scheduler.schedule()
    finished = scheduler.update(out, {stopper.seq_id: [EOS], other.seq_id: [7]})
    assert finished == [stopper] and stopper.finish_reason == "stop" and stopper.output_token_ids == [EOS]
    assert scheduler.abort("other") is other and other.finish_reason == "abort"
    assert scheduler.abort("unknown") is None
    assert not scheduler.has_unfinished and bm.num_free_blocks == 32


def test_max_num_seqs_bounds_the_running_set():
    seqs = [seq_of(p, max_new_tokens=3, request_id=str(i)) for i, p in enumerate(prompts(5, 6))]
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, 4), {EOS})
    assert run(scheduler, seqs) == reference_outputs(seqs)
