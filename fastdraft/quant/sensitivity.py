"""Which kinds of decoder linears buy the most accuracy per byte when kept at INT8.

INT4 error is not spread evenly over a model: on Qwen2.5-Coder-0.5B, v_proj and o_proj hold 2%
of the weight bytes and a far larger share of the perplexity loss. This measures it the way
accuracy-driven tuning (Intel Neural Compressor's op-type fallback) does: each kind of linear
(q_proj, ..., down_proj) in turn is kept at INT8 in every layer of an RTN configuration, and the
mean KL it saves against the reference is divided by the bytes it adds. The auto flow turns the
ranking into nested INT8 sets to try (``AutoSearchSpace.num_int8_sets``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

from fastdraft.models.files import LoadedModel, build_model
from fastdraft.quant.quant_config import LAYER_LINEARS, QuantConfig
from fastdraft.quant.evaluate import EvalWindows, ReferenceScores, evaluate
from fastdraft.quant.quantizer import quantize_model


@dataclass
class Int8Gain:
    """What keeping one kind of linear at INT8 in every layer buys and costs."""

    name: str  # e.g. "self_attn.v_proj"
    kl_saved: float  # mean KL(reference || model) of the base config minus that with this kind at INT8
    extra_bytes: int  # decode weight bytes added

    @property
    def kl_saved_per_mb(self) -> float:
        return self.kl_saved / max(self.extra_bytes, 1) * 1e6

    def to_dict(self) -> dict:
        return {**asdict(self), "kl_saved_per_mb": self.kl_saved_per_mb}


def rank_int8_linears(loaded: LoadedModel, state: dict[str, torch.Tensor], windows: EvalWindows,
                      ref_scores: ReferenceScores, base: QuantConfig, show_progress: bool = True) -> list[Int8Gain]:
    """The kinds of decoder linears whose INT8 copy saves KL, the most KL saved per byte first.

    ``base`` is an RTN config without ``int8_linears``; each measurement quantizes a fresh
    model built from ``state`` (8 quantize-and-evaluate passes in all)."""
    if base.method != "rtn" or base.int8_linears:
        raise ValueError("the sensitivity base must be an RTN config without int8_linears")

    def measure(names: tuple[str, ...]) -> tuple[float, int]:
        model = build_model(loaded.config, state, loaded.model.dtype, loaded.model.device)
        config = replace(base, int8_linears=names)
        quantize_model(model, config, None, show_progress=False)
        return evaluate(model, windows, ref_scores, label=config.label, show_progress=False).mean_kl, \
            model.decode_weight_bytes()

    base_kl, base_bytes = measure(())
    gains = []
    for name in tqdm(LAYER_LINEARS, desc="INT8 sensitivity", disable=not show_progress, leave=False):
        kl, num_bytes = measure((name,))
        gains.append(Int8Gain(name, base_kl - kl, num_bytes - base_bytes))
    return sorted((g for g in gains if g.kl_saved > 0), key=lambda g: g.kl_saved_per_mb, reverse=True)


def nested_int8_sets(gains: list[Int8Gain], num_sets: int) -> tuple[tuple[str, ...], ...]:
    """``[v, o, k]`` -> ``((v,), (v, o), (v, o, k))`` for the first ``num_sets`` gains."""
    names = [g.name for g in gains[:num_sets]]
    return tuple(tuple(names[:i]) for i in range(1, len(names) + 1))
