"""A separate draft model, vLLM style: a small model of the same tokenizer proposes tokens
that the target verifies, greedy and sampled (rejection sampling keeps the target's
distribution exactly).

    python examples/draft_model_vllm.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --low-bit sym_int4
"""

from __future__ import annotations

import argparse

from fastdraft import LLM, SamplingParams, configure_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target: known name or HF folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="the draft, or 'self' or 'ngram'")
    parser.add_argument("--low-bit", default="sym_int4", help="the target's load_in_low_bit (sym_int4, bf16, ...)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    configure_process()  # process-wide malloc settings: the library leaves them to its entry points

    llm = LLM(model=args.model, load_in_low_bit=args.low_bit, speculative_model=args.draft,
              num_speculative_tokens=args.num_speculative_tokens)
    prompts = ["def binary_search(items, target):\n", "class LRUCache:\n"]
    for temperature in (0.0, 0.7):
        # No seed: a seeded sampled request decodes plainly, so that its tokens do not depend on
        # the draft lengths the load chooses.
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=temperature)
        for output in llm.generate(prompts, params):
            metrics = output.metrics
            print(f"--- T={temperature} | {metrics.num_generated_tokens} tokens | TTFT {metrics.ttft_s * 1e3:.0f} ms "
                  f"| TPOT {metrics.tpot_s * 1e3:.1f} ms | "
                  f"{metrics.spec.summary() if metrics.spec else 'no decoding step'}")
            print(output.prompt + output.outputs[0].text)


if __name__ == "__main__":
    main()
