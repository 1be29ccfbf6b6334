"""Apply a :class:`QuantConfig` to a model: RTN, GPTQ or AWQ, sharing one calibration pass.

Calibration runs the decoder one layer at a time (as the GPTQ and AWQ papers do): each
layer sees inputs produced by the already-quantized layers before it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdraft.formats import PER_CHANNEL, QuantizedWeight, WeightFormat, quantize
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.layers.quant_linear import QuantEmbedding, QuantLinear, exact_min_rows
from fastdraft.models.causal_lm import CausalLM, DecoderLayer
from fastdraft.quant import awq
from fastdraft.quant.quant_config import ATTN_INPUT, LAYER_LINEARS, MLP_INPUT, QuantConfig
from fastdraft.quant.gptq import HessianAccumulator, gptq_quantize

logger = logging.getLogger(__name__)

_AWQ_MAX_ROWS = 4096  # calibration rows kept per linear input for AWQ's searches


class _LayerwiseRunner:
    """Feeds calibration samples through the decoder one layer at a time."""

    def __init__(self, model: CausalLM, samples: list[torch.Tensor]) -> None:
        seq_len = samples[0].shape[1]
        # Every sample runs as the one sequence of a cache of its own, at positions 0..seq_len-1:
        # one layout serves them all (each overwrites the last one's keys and values).
        cache = SequenceCache.from_config(model.config, seq_len, dtype=model.dtype, device=model.device)
        self.kv_cache = cache.kv_cache
        _, self.meta = cache.append(samples[0][0])
        self.rotary_rows = model.model.rotary_rows(self.meta.positions, model.dtype)  # [seq_len, rotary_dim] each
        with torch.no_grad():
            # [seq_len, hidden_size] each
            self.hidden = [model.model.embed(s[0].to(model.device)) for s in samples]

    @torch.no_grad()
    def run(self, layer: DecoderLayer) -> list[torch.Tensor]:
        return [layer(h, self.rotary_rows, self.kv_cache, self.meta) for h in self.hidden]


@contextmanager
def _capture_inputs(layer: nn.Module, names: tuple[str, ...], sink) -> Iterator[None]:
    """Call ``sink(name, x)`` with the input of each named submodule while active."""
    handles = [layer.get_submodule(name).register_forward_pre_hook(
        lambda _m, args, name=name: sink(name, args[0])) for name in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def replace_module(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent_name) if parent_name else layer, child, module)


def quant_linear(linear: nn.Linear, qw: QuantizedWeight) -> QuantLinear:
    """The quantized replacement of ``linear``: weight ``qw``, and a copy of its bias."""
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return QuantLinear(qw, bias)


def _rtn(weight: torch.Tensor, fmt: WeightFormat) -> QuantizedWeight:
    return quantize(weight, *fmt)


def _quantize_layer_rtn(layer: DecoderLayer, config: QuantConfig, num_layers: int) -> None:
    for name in LAYER_LINEARS:
        linear = layer.get_submodule(name)
        fmt = config.layer_format(layer.self_attn.layer_idx, num_layers, name)
        replace_module(layer, name, quant_linear(linear, _rtn(linear.weight, fmt)))


def _quantize_layer_gptq(layer: DecoderLayer, runner: _LayerwiseRunner, config: QuantConfig,
                         num_layers: int) -> None:
    accumulators = {name: HessianAccumulator(layer.get_submodule(name).in_features) for name in LAYER_LINEARS}
    with _capture_inputs(layer, LAYER_LINEARS, lambda name, x: accumulators[name].add(x)):
        runner.run(layer)
    for name in LAYER_LINEARS:
        linear = layer.get_submodule(name)
        fmt = config.layer_format(layer.self_attn.layer_idx, num_layers, name)
        if fmt[0] == 8:  # INT8 per channel is close to lossless: plain rounding
            qw = _rtn(linear.weight, fmt)
        else:
            qw = gptq_quantize(linear.weight, accumulators[name].hessian, config.group_size, config.sym,
                               config.act_order, config.damp_percent, config.float_zeros)
        replace_module(layer, name, quant_linear(linear, qw))


def _quantize_layer_awq(layer: DecoderLayer, runner: _LayerwiseRunner, config: QuantConfig,
                        num_layers: int) -> None:
    inputs: dict[str, list[torch.Tensor]] = {}
    wanted = (ATTN_INPUT[0], "self_attn.o_proj", MLP_INPUT[0], "mlp.down_proj")

    def keep(name: str, x: torch.Tensor) -> None:
        inputs.setdefault(name, []).append(x.reshape(-1, x.shape[-1]).float())

    with _capture_inputs(layer, wanted, keep):
        runner.run(layer)
    x = {}
    for name, chunks in inputs.items():
        x[name] = awq.even_rows(torch.cat(chunks), _AWQ_MAX_ROWS)
    attn, mlp = layer.self_attn, layer.mlp
    # (op producing the input, linears consuming it, the name their input was captured under)
    groups = [
        (layer.input_layernorm, ATTN_INPUT, ATTN_INPUT[0]),
        (layer.post_attention_layernorm, MLP_INPUT, MLP_INPUT[0]),
        (mlp.up_proj, ("mlp.down_proj",), "mlp.down_proj"),
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # v -> o folds only without GQA
        groups.append((attn.v_proj, ("self_attn.o_proj",), "self_attn.o_proj"))
    scaled_inputs: dict[str, torch.Tensor] = {"self_attn.o_proj": x["self_attn.o_proj"]}
    for prev, names, input_name in groups:
        linears = [layer.get_submodule(n) for n in names]
        scales = awq.search_scales(x[input_name], [lin.weight for lin in linears], config.group_size, config.sym,
                                   config.float_zeros)
        awq.fold_scales(prev, linears, scales)
        for n in names:  # after folding, these linears see x / s
            scaled_inputs[n] = x[input_name] / scales
    for name in LAYER_LINEARS:
        linear = layer.get_submodule(name)
        weight = linear.weight
        fmt = config.layer_format(layer.self_attn.layer_idx, num_layers, name)
        if config.awq_clip and fmt[0] == 4 and name not in ("self_attn.q_proj", "self_attn.k_proj"):  # q/k feed a softmax
            weight = awq.search_clip(scaled_inputs[name], weight, config.group_size, config.sym, config.float_zeros)
        replace_module(layer, name, quant_linear(linear, _rtn(weight, fmt)))


def quantize_model(model: CausalLM, config: QuantConfig,
                   calib_samples: list[torch.Tensor] | None = None, show_progress: bool = True) -> CausalLM:
    """Quantize ``model`` in place (decoder linears, then lm_head / embeddings) and return it."""
    if config.is_gguf_native:
        raise ValueError("method=gguf keeps a GGUF file's own blocks: load the model with keep_gguf_quant=True "
                         "(--keep-gguf-quant) instead of quantizing it")
    if config.needs_calibration:
        if not calib_samples:
            raise ValueError(f"{config.method} needs calibration samples")
        if config.bits != 4:
            raise ValueError(f"{config.method} is implemented for 4-bit weights")
    layers = model.model.layers
    runner = _LayerwiseRunner(model, calib_samples) if config.needs_calibration else None
    for layer in tqdm(layers, desc=f"quantizing ({config.label})", disable=not show_progress, leave=False):
        if config.method == "gptq":
            _quantize_layer_gptq(layer, runner, config, len(layers))
        elif config.method == "awq":
            _quantize_layer_awq(layer, runner, config, len(layers))
        else:
            _quantize_layer_rtn(layer, config, len(layers))
        if runner is not None:
            runner.hidden = runner.run(layer)  # the next layer sees this layer's quantized outputs
    _quantize_head_and_embeddings(model, config)
    model.quant_config = config
    model.min_rows = exact_min_rows(model)
    return model


def _quantize_head_and_embeddings(model: CausalLM, config: QuantConfig) -> None:
    head_format = config.head_format()
    if head_format is not None:
        head = model.lm_head
        model.lm_head = quant_linear(head, quantize(head.weight, *head_format))
    if config.embed_bits == 8:
        embed = model.model.embed_tokens
        model.model.embed_tokens = QuantEmbedding(quantize(embed.weight, 8, PER_CHANNEL, sym=True))
