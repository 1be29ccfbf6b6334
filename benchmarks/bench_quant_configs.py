"""Quantized configurations side by side: weight bytes read per token and the batch-1 decode
step (the one ``quantize --auto`` ranks by, ``DecodeStepTimer``), each beside the unquantized
reference, the models taking turns over ``--rounds`` rounds (medians, and ratios to the
reference).

    python benchmarks/bench_quant_configs.py --model qwen2.5-coder-1.5b-instruct \\
        --quant "method=rtn,group_size=32,sym=false,float_zeros=true" \\
        --quant "method=rtn,group_size=32,sym=false,float_zeros=true,int8_linears=v_proj"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fastdraft.engine.loader import load_model  # noqa: E402
from fastdraft.engine.timing import DecodeStepTimer  # noqa: E402
from fastdraft.fileio import write_json  # noqa: E402
from fastdraft.kernels.build import cpu_model  # noqa: E402
from fastdraft.models.registry import KNOWN_MODELS  # noqa: E402
from fastdraft.quant.quant_config import parse_quant_spec  # noqa: E402
from fastdraft.quant.quantizer import quantize_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", choices=list(KNOWN_MODELS))
    parser.add_argument("--quant", action="append", required=True, help="a RTN/INT8/INT6 spec (repeatable)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per model and round")
    parser.add_argument("--json", type=Path, default=Path("bench_results/quant_configs.json"))
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads", flush=True)
    configs = [parse_quant_spec(spec) for spec in args.quant]
    if any(c.needs_calibration for c in configs):
        parser.error("calibrated methods (GPTQ, AWQ) are not timed here: their layout is RTN's")
    reference = load_model(args.model, dtype="bf16", keep_gguf_quant=False).model
    models = [reference]
    for config in configs:
        model = load_model(args.model, dtype="bf16", keep_gguf_quant=False).model
        models.append(quantize_model(model, config, None, show_progress=False))
    times = DecodeStepTimer(args.steps).time_interleaved(models, args.rounds)
    rows = [{"config": "bf16 reference" if i == 0 else configs[i - 1].label,
             "weight_mb": model.decode_weight_bytes() / 1e6, "decode_ms": ms, "speedup": times[0] / ms}
            for i, (model, ms) in enumerate(zip(models, times))]
    print(f"| config | weights MB | decode ms/token (median of {args.rounds}) | speedup |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['config']} | {row['weight_mb']:.0f} | {row['decode_ms']:.2f} | {row['speedup']:.2f}x |")
    write_json(args.json, {"model": args.model, "cpu": cpu_model(), "rounds": args.rounds, "rows": rows})
    print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
