#!/usr/bin/env bash
# Every GPU check in one command, for a machine with torch, triton and transformers and no
# network (run from a source checkout): the CUDA tests, bench_gpu.py's cases for the 0.5B shape
# (bf16 and INT4, graphs and eager, batch 1 and 64, HF eager beside them), then the 1.5B shape
# with a 0.5B-shaped draft on the CPU. Logs and JSON go to $OUT (default bench_results/gpu).
set -o pipefail
out=${OUT:-bench_results/gpu}
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
timeout "${TEST_TIMEOUT:-210}" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/layers/test_triton_attention.py tests/layers/test_triton_ops.py tests/models/test_cuda.py \
    tests/models/test_cuda_decoder.py tests/engine/test_cuda_graphs.py tests/speculative/test_cuda_spec.py \
    tests/layers/test_rejection_sampler.py::test_keyed_rejection_sampler_equals_its_twin_on_cuda \
    tests/layers/test_sampler.py::test_batched_extras_equal_the_twin_on_cuda \
    2>&1 | tee "$out/tests.txt" | tail -25
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_gpu.py --random-weights qwen2.5-coder-0.5b-instruct \
    --num-seqs 1,64 --quant none,int4 --modes graphs,eager --profile --profile-tables /tmp/gpu_profiles \
    --json "$out/gpu.json" 2>&1 | grep -v "^STAGE\|USDT" | tee "$out/bench.txt" | tail -12
cp /tmp/gpu_profiles/bf16_none_graphs_64.txt /tmp/gpu_profiles/bf16_none_eager_64.txt \
    /tmp/gpu_profiles/bf16_none_graphs_1.txt "$out/" 2>/dev/null
timeout "${DRAFT_TIMEOUT:-150}" python3 benchmarks/bench_gpu.py --random-weights qwen2.5-coder-1.5b-instruct \
    --num-seqs 1 --quant none --modes graphs --no-hf --cpu-draft qwen2.5-coder-0.5b-instruct \
    --json "$out/gpu_draft.json" 2>&1 | grep -v "^STAGE\|USDT" | tee "$out/draft.txt" | tail -6
