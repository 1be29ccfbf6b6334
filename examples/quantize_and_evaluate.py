"""Weight-only INT4 quantization from Python: quantize with GPTQ, save an atomic checkpoint,
load it back and measure perplexity, KL and top-1 agreement against the unquantized model
on the held-out test set (CPython sources and public-domain prose).

    python examples/quantize_and_evaluate.py --model qwen2.5-coder-0.5b-instruct \
        --quant method=gptq,group_size=128 --output /tmp/qwen-0.5b-gptq
"""

from __future__ import annotations

import argparse

from fastdraft import load_model
from fastdraft.fileio import check_output_path
from fastdraft.quant.checkpoint import save_quantized
from fastdraft.quant.quant_config import parse_quant_spec
from fastdraft.quant.data import TEST, calibration_samples
from fastdraft.quant.evaluate import EvalWindows, evaluate, format_table, score_reference
from fastdraft.quant.quantizer import quantize_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="known name or HF folder")
    parser.add_argument("--quant", default="method=gptq,group_size=128", help="key=value,... as in `fastdraft quantize`")
    parser.add_argument("--output", required=True, help="folder for the quantized checkpoint")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per evaluation window")
    args = parser.parse_args()
    # A bad spec or an unwritable output fails here, before minutes of work.
    try:
        config = parse_quant_spec(args.quant)
        check_output_path(args.output, is_dir=True)
    except ValueError as exc:
        parser.error(str(exc))

    reference = load_model(args.model, dtype="bf16", keep_gguf_quant=False)
    samples = None
    if config.needs_calibration:  # GPTQ and AWQ see calibration text (stdlib code and prose)
        samples = calibration_samples(reference.tokenizer, config.num_calib_samples, config.calib_seq_len,
                                      config.seed)
    candidate = load_model(args.model, dtype="bf16", keep_gguf_quant=False)
    quantize_model(candidate.model, config, samples)
    save_quantized(candidate.model, args.output, candidate.model_dir)

    reloaded = load_model(args.output, dtype="bf16")
    seq_len = min(args.seq_len, reference.config.max_position_embeddings)
    windows = EvalWindows.for_set(reference.tokenizer, TEST, seq_len=seq_len)
    reference_scores = score_reference(reference.model, windows)
    result = evaluate(reloaded.model, windows, reference_scores, label=config.label)
    print(format_table([reference_scores.result, result]))
    print(f"saved {config.label} to {args.output}")


if __name__ == "__main__":
    main()
