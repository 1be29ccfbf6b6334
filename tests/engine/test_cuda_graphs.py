"""Decode steps from CUDA graphs: bucket choice, padding, the static inputs, and the runner's
choice of graph or eager steps. On a GPU with real graphs; without one, with a stand-in graph
that replays the captured pass eagerly, through Triton's interpreter (fp32, tiny model)."""

from __future__ import annotations

import os

import pytest
import torch

from fastdraft.engine.block_manager import BlockManager
from fastdraft.engine.cuda_graphs import CudaGraph, DecodeGraphs, bucket_for, graph_buckets
from fastdraft.engine.loader import load_model
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.scheduler import SchedulerOutput
from fastdraft.engine.sequence import Sequence
from fastdraft.kernels import triton_ops
from fastdraft.layers.kv_cache import PagedKVCache, Span, flat_batch
from fastdraft.models.cuda_decoder import CudaDecoder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
needs_triton = pytest.mark.skipif(
    not triton_ops.is_available() or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton, on a GPU or through its interpreter (TRITON_INTERPRET=1, set by conftest)")


class StandInGraph:
    """A graph without CUDA: capture runs the pass and keeps it; replay runs it again into the
    captured output, as a real graph's replay overwrites its output tensor."""

    def __init__(self, pool=None) -> None:
        self.pool = pool

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


GRAPH_TYPE = CudaGraph if DEVICE == "cuda" else StandInGraph


def test_buckets():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(1) == [1]
    assert [bucket_for(n, graph_buckets(64)) for n in (1, 3, 5, 9, 17, 33, 64, 65)] == [1, 4, 8, 16, 32, 48, 64, None]
    with pytest.raises(ValueError, match="positive"):
        graph_buckets(0)


def _decoder(loaded) -> CudaDecoder:
    model = loaded.model
    if DEVICE == "cuda":
        return model.fused_decoder(BLOCK_SIZE)
    return CudaDecoder(model, model.dtype, model.device, model.min_rows)


def _prefilled(loaded, decoder, prompts, tables, num_blocks):
    cache = PagedKVCache.from_config(loaded.config, num_blocks, BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
    input_ids, meta = flat_batch([Span(p, 0, t) for p, t in zip(prompts, tables)], BLOCK_SIZE, DEVICE)
    decoder.forward_paged(input_ids, meta.positions, cache, meta)
    return cache


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
@needs_triton
@torch.inference_mode()
def test_graph_steps_match_eager_steps(tiny_models, num_seqs):
    """Decode steps padded to their bucket give the eager step's logits and cache writes; the
    padding rows write nothing (the dummy block keeps its zeros)."""
    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32", device=DEVICE)
    decoder = _decoder(loaded)
    gen = torch.Generator().manual_seed(num_seqs)
    prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 9, 28, 2)]
    prompts = prompts[:num_seqs]
    tables = [[2 * i, 2 * i + 1] for i in range(num_seqs)]
    dummy = 2 * num_seqs
    eager_cache = _prefilled(loaded, decoder, prompts, tables, dummy + 1)
    graph_cache = _prefilled(loaded, decoder, prompts, tables, dummy + 1)
    graphs = DecodeGraphs(decoder, loaded.model.compute_logits, graph_cache, max_num_seqs=8, max_model_len=64,
                          dummy_block=dummy, graph_type=GRAPH_TYPE)
    graphs.capture()
    lengths = [len(p) for p in prompts]
    for step in range(3):
        tokens = torch.randint(3, loaded.config.vocab_size, (num_seqs,), generator=gen).tolist()
        got = graphs.run(tokens, lengths, tables).cpu()  # [num_seqs, vocab_size]
        input_ids, meta = flat_batch([Span([t], n, table) for t, n, table in zip(tokens, lengths, tables)],
                                     BLOCK_SIZE, DEVICE)
        want = loaded.model.compute_logits(decoder.forward_paged(input_ids, meta.positions, eager_cache, meta)).cpu()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        lengths = [n + 1 for n in lengths]
    torch.testing.assert_close(graph_cache.k, eager_cache.k, atol=1e-5, rtol=1e-5)
    assert not graph_cache.k[:, dummy].any() and not graph_cache.v[:, dummy].any()


@needs_triton
@torch.inference_mode()
def test_a_rows_logits_do_not_depend_on_its_batch_mates_at_one_bucket(tiny_models):
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
    decoder = _decoder(loaded)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (12, 20, 3, 33, 7)]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(5)]
    cache = _prefilled(loaded, decoder, prompts, tables, 16)
    graphs = DecodeGraphs(decoder, loaded.model.compute_logits, cache, max_num_seqs=4, max_model_len=48,
                          dummy_block=15, graph_type=GRAPH_TYPE)
    graphs.capture()
    rows = []
    for mates in ([1, 2], [3, 4]):  # three sequences, bucket 4, other mates
        seqs = [0] + mates
        logits = graphs.run([5] + [6] * len(mates), [len(prompts[s]) for s in seqs], [tables[s] for s in seqs])
        rows.append(logits[0].clone())
    assert torch.equal(rows[0], rows[1])


@needs_triton
@torch.inference_mode()
def test_runner_replays_graphs_for_pure_decode_steps_only(tiny_models):
    """The runner decodes through the graphs and prefills eagerly, and its tokens are the eager
    runner's."""
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
    runners = []
    for graphs in (False, True):
        manager = BlockManager(12, BLOCK_SIZE, enable_prefix_caching=False)
        cache = PagedKVCache.from_config(loaded.config, 13, BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
        runner = ModelRunner(loaded.model, cache, manager, batch_invariant=False)
        if DEVICE == "cpu":
            runner.decoder = CudaDecoder(loaded.model, loaded.model.dtype, loaded.model.device, loaded.model.min_rows)
        if graphs:
            assert runner.capture_graphs(max_num_seqs=4, max_model_len=64, graph_type=GRAPH_TYPE)
        runners.append(runner)
    outputs = []
    for runner in runners:
        seqs = [Sequence([3, 9, 4, 11, 5][:n]) for n in (5, 3, 4)]
        replayed = []
        num_scheduled = [seq.num_tokens for seq in seqs]  # the prompts: a prefill step
        for _ in range(4):
            for seq, num in zip(seqs, num_scheduled):
                assert runner.block_manager.append_slots(seq, num)
            output = SchedulerOutput(seqs=list(seqs), num_scheduled_tokens=num_scheduled)
            replayed.append(runner.is_graph_step(output))
            new_tokens = runner.execute(output)
            for seq, num in zip(seqs, num_scheduled):
                seq.num_computed_tokens += num
                seq.append_token(new_tokens[seq.seq_id][0])
            num_scheduled = [1] * len(seqs)
        outputs.append([seq.output_token_ids for seq in seqs])
        assert replayed == ([False, True, True, True] if runner.graphs is not None else [False] * 4)
    assert outputs[0] == outputs[1]


def test_capture_needs_the_gpu_step_and_a_spare_block(tiny_models):
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32")
    manager = BlockManager(4, BLOCK_SIZE)
    runner = ModelRunner(loaded.model, PagedKVCache.from_config(loaded.config, 5, BLOCK_SIZE, dtype=torch.float32),
                         manager)
    assert not runner.capture_graphs(4, 64, graph_type=StandInGraph)  # the C++ step, not the GPU's
    runner.decoder = CudaDecoder(loaded.model, loaded.model.dtype, loaded.model.device, loaded.model.min_rows)
    runner.kv_cache = PagedKVCache.from_config(loaded.config, 4, BLOCK_SIZE, dtype=torch.float32)
    assert not runner.capture_graphs(4, 64, graph_type=StandInGraph)  # no block for the padding rows
    with pytest.raises(ValueError, match="dummy block"):
        DecodeGraphs(runner.decoder, loaded.model.compute_logits, runner.kv_cache, 4, 64, dummy_block=4)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,low_bit", [("fp32", None), ("bf16", "sym_int4")])
def test_engine_decodes_the_same_tokens_with_graphs_and_eagerly(tiny_models, dtype, low_bit):
    from fastdraft.llm import LLM
    from fastdraft.sampling_params import SamplingParams

    prompts = [[3 + i, 17, 40 + 3 * i, 9][: 2 + i % 3] for i in range(5)]
    outputs = []
    for eager in (False, True):
        llm = LLM(str(tiny_models.dir("llama")), dtype=dtype, device=DEVICE, load_in_low_bit=low_bit, max_num_seqs=8,
                  max_model_len=128, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        if low_bit:
            model = llm.engine.runner.model
            assert model.model.layers[0].mlp.down_proj.kernel_for(model.dtype, model.device).name == "aten-int4-cuda"
        results = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, detokenize=False),
                               use_tqdm=False)
        outputs.append([out.outputs[0].token_ids for out in results])
    assert outputs[0] == outputs[1]


@needs_triton
@torch.inference_mode()
def test_time_pass_replays_the_graphs_where_they_take_the_pass(tiny_models, monkeypatch):
    """The speculative cost model's plain-step timing goes through the graphs, and falls back to
    an eager pass for a context the graphs do not hold."""
    loaded = load_model(tiny_models.dir("llama"), dtype="fp32", device=DEVICE)
    manager = BlockManager(12, BLOCK_SIZE, enable_prefix_caching=False)
    cache = PagedKVCache.from_config(loaded.config, 13, BLOCK_SIZE, dtype=torch.float32, device=DEVICE)
    runner = ModelRunner(loaded.model, cache, manager, batch_invariant=False)
    if DEVICE == "cpu":
        runner.decoder = CudaDecoder(loaded.model, loaded.model.dtype, loaded.model.device, loaded.model.min_rows)
    assert runner.capture_graphs(max_num_seqs=2, max_model_len=32, graph_type=GRAPH_TYPE)
    replays = []
    monkeypatch.setattr(runner.graphs, "run", lambda *args: replays.append(args))
    runner.time_pass(2, 20, repeats=1, use_graphs=True)
    assert len(replays) == 2  # the warm-up and one timed pass
    runner.time_pass(2, 40, repeats=1, use_graphs=True)  # past max_model_len: eager
    runner.time_pass(1, 20, repeats=1)  # eager unless asked
    assert len(replays) == 2 and manager.num_free_blocks == 12
