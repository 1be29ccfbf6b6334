"""Self-speculative decoding, HF style: the model drafts for itself with its own INT4 copy.

``speculative=True`` quantizes a copy of the target to INT4 at load time; greedy output is
token for token what plain greedy decoding gives, only sooner.

    python examples/speculative_hf.py --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import time

import fastdraft


def timed_generate(model, input_ids, max_new_tokens: int):
    start = time.perf_counter()
    output_ids = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
    return output_ids, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="known name or HF folder")
    parser.add_argument("--prompt", default="def quicksort(items):\n")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    fastdraft.configure_process()  # process-wide malloc settings: the library leaves them to its entry points

    plain = fastdraft.AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="bf16")
    speculative = fastdraft.AutoModelForCausalLM.from_pretrained(args.model, load_in_low_bit="bf16", speculative=True)
    input_ids = plain.tokenizer.encode(args.prompt)

    timed_generate(plain, input_ids, 4)  # warm-up: builds the kernels and the fused decode step
    timed_generate(speculative, input_ids, 4)
    plain_ids, plain_s = timed_generate(plain, input_ids, args.max_new_tokens)
    spec_ids, spec_s = timed_generate(speculative, input_ids, args.max_new_tokens)

    print(speculative.tokenizer.decode(spec_ids[0, len(input_ids):].tolist()))
    print(f"plain {plain_s:.2f} s, self-speculative {spec_s:.2f} s ({plain_s / spec_s:.2f}x); "
          f"identical greedy output: {plain_ids.tolist() == spec_ids.tolist()}")


if __name__ == "__main__":
    main()
