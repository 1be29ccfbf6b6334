"""Where a draft's acceptance goes, position by position, on fixed target trajectories.

The target generates ``--new-tokens`` tokens after the first ``--prompt-tokens`` tokens of a
held-out stdlib module, per seed (T > 0) or per module (greedy). Then the target and each draft
score those whole sequences in one pass. Per position we report the chance that a one-token
draft is accepted: sum(min(target, draft)) for sampling, or argmax agreement for greedy. We
also split the positions by the draft's confidence (top probability >= ``--min-confidence``),
the signal the adaptive draft length stops on (fastdraft/speculative/draft_length.py).

    python benchmarks/acceptance_study.py --temperature 0.7 --drafts bf16,rtn
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from fastdraft.generator import TextGenerator
from fastdraft.engine.loader import load_model
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.fused_decoder import FusedDecoder
from fastdraft.models.causal_lm import CausalLM
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.data import SELECTION_CODE_FILES, calibration_samples, stdlib_root
from fastdraft.quant.quantizer import quantize_model
from fastdraft.sampling_params import SamplingParams
from fastdraft.speculative.speculative_config import SpeculativeConfig
from fastdraft.speculative.factory import prepare_draft


@torch.inference_mode()
def next_token_logits(model: CausalLM, prompt: list[int], new_ids: list[int],
                      decoder: FusedDecoder | None) -> torch.Tensor:
    """Logits [len(new_ids), vocab] that predict each of ``new_ids`` after ``prompt``, through
    ``decoder`` (the model's C++ step, built once per model: building packs its weights) or,
    when None, the module path."""
    seq = prompt + new_ids
    cache = SequenceCache.from_config(model.config, len(seq), dtype=model.dtype)
    input_ids, meta = cache.append(seq)
    rows = list(range(len(prompt) - 1, len(seq) - 1))
    return model.logits(input_ids, meta.positions, cache.kv_cache, meta, rows, decoder)


def make_draft(name: str, kind: str):
    """The draft as speculative decoding builds it (``rtn``), unquantized (``bf16``) or GPTQ."""
    draft = load_model(name, dtype="bf16", keep_gguf_quant=False)
    config = SpeculativeConfig(draft=name)
    if kind == "rtn":
        return prepare_draft(draft, config)
    draft, token_ids = prepare_draft(draft, replace(config, draft_low_bit=None))  # the head restricted only
    if kind == "gptq":
        quant = QuantConfig(method="gptq", group_size=config.draft_group_size, lm_head_bits=config.draft_lm_head_bits)
        samples = calibration_samples(draft.tokenizer, quant.num_calib_samples, quant.calib_seq_len, quant.seed)
        quantize_model(draft.model, quant, samples)
    elif kind != "bf16":
        raise SystemExit(f"unknown draft kind {kind!r}: choose bf16, rtn or gptq")
    return draft, token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--drafts", default="rtn", help="comma-separated: bf16, rtn (as speculation builds it), gptq")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeds", type=int, default=3, help="trajectories at T > 0 (greedy: one per module)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-confidence", type=float, default=SpeculativeConfig.min_confidence)
    args = parser.parse_args()
    is_greedy = args.temperature == 0
    target = load_model(args.target, dtype="bf16", load_in_low_bit="sym_int4")  # as bench_spec.py's target
    tokenizer = target.tokenizer
    files = SELECTION_CODE_FILES[:args.seeds] if is_greedy else SELECTION_CODE_FILES[:1] * args.seeds
    prompts = [tokenizer.encode((stdlib_root() / f).read_text(encoding="utf-8"), add_special_tokens=False)
               [:args.prompt_tokens] for f in files]
    generator = TextGenerator(target, max_seq_len=args.prompt_tokens + args.new_tokens + 8)
    trajectories = [generator.generate(p, SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature,
                                                         seed=i, ignore_eos=True)).token_ids
                    for i, p in enumerate(prompts)]
    target_decoder = target.model.fused_decoder()
    target_rows = [next_token_logits(target.model, p, t, target_decoder) for p, t in zip(prompts, trajectories)]
    vocab_size = target.config.vocab_size
    del generator, target, target_decoder
    print(f"{len(trajectories)} trajectories x {args.new_tokens} tokens, T={args.temperature}, "
          f"confident = top probability >= {args.min_confidence}")
    print("| draft | acceptance | confident share | acceptance when confident | otherwise |")
    print("|---|---:|---:|---:|---:|")
    for kind in args.drafts.split(","):
        draft, token_ids = make_draft(args.draft, kind)
        decoder = draft.model.fused_decoder()
        accepted, confidence = [], []
        for prompt, new_ids, target_logits in zip(prompts, trajectories, target_rows):
            logits = next_token_logits(draft.model, prompt, new_ids, decoder)  # [new, draft_vocab]
            draft_probs = torch.softmax(logits if is_greedy else logits / args.temperature, dim=-1)
            confidence.append(draft_probs.max(dim=-1).values)
            ids = token_ids if token_ids is not None else torch.arange(draft_probs.shape[-1])
            keep = ids < vocab_size  # padded draft rows carry no token of the target's
            if is_greedy:
                accepted.append((ids[logits.argmax(dim=-1)] == target_logits.argmax(dim=-1)).float())
            else:
                target_probs = torch.softmax(target_logits / args.temperature, dim=-1)[:, ids[keep]]
                accepted.append(torch.minimum(target_probs, draft_probs[:, keep]).sum(dim=-1))
        accepted_all, confidence_all = torch.cat(accepted), torch.cat(confidence)
        is_sure = confidence_all >= args.min_confidence
        print(f"| {kind} | {accepted_all.mean():.3f} | {is_sure.float().mean():.2f} | "
              f"{accepted_all[is_sure].mean():.3f} | {accepted_all[~is_sure].mean():.3f} |", flush=True)


if __name__ == "__main__":
    main()
