"""GPTQ and AWQ against RTN on a synthetic layer whose inputs have outlier channels."""

import pytest
import torch

from fastdraft.formats import dequantize, quantize
from fastdraft.quant import awq
from fastdraft.quant.gptq import HessianAccumulator, gptq_quantize


def _outlier_layer(seed: int = 0, rows: int = 2048, k: int = 256, n: int = 128):
    gen = torch.Generator().manual_seed(seed)
    # Correlated activations with a few large-magnitude channels, as seen in real LLMs.
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=gen) @ mix
    outliers = torch.randperm(k, generator=gen)[:8]
    x[:, outliers] *= 20.0
    w = torch.randn(n, k, generator=gen) * 0.05
    return x, w


def _output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (x @ w_hat.t() - x @ w.t()).pow(2).mean().item()


SCHEMES = {"sym": (True, False), "asym": (False, False), "asymf": (False, True)}  # (sym, float_zeros)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn(group_size, scheme, act_order):
    sym, float_zeros = SCHEMES[scheme]
    x, w = _outlier_layer()
    acc = HessianAccumulator(w.shape[1])
    for chunk in x.split(512):
        acc.add(chunk)
    rtn = _output_error(x, w, dequantize(quantize(w, 4, group_size, sym, float_zeros)))
    qw = gptq_quantize(w, acc.hessian, group_size, sym, act_order, float_zeros=float_zeros)
    assert qw.has_float_zeros == float_zeros
    assert _output_error(x, w, dequantize(qw)) < 0.8 * rtn


def test_hessian_accumulator_matches_direct_formula():
    x = torch.randn(300, 16)
    acc = HessianAccumulator(16)
    for chunk in x.split(70):
        acc.add(chunk)
    assert torch.allclose(acc.hessian, 2 * x.t() @ x / 300, atol=1e-4)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_awq_beats_rtn(group_size, scheme):
    sym, float_zeros = SCHEMES[scheme]
    x, w = _outlier_layer(seed=1)
    rtn = _output_error(x, w, dequantize(quantize(w, 4, group_size, sym, float_zeros)))
    scales = awq.search_scales(x, [w], group_size, sym, float_zeros)
    w_scaled = awq.search_clip(x / scales, w * scales, group_size, sym, float_zeros)
    w_awq = dequantize(quantize(w_scaled, 4, group_size, sym, float_zeros)) / scales
    assert _output_error(x, w, w_awq) < 0.8 * rtn


def test_awq_fold_preserves_the_function():
    from torch import nn

    from fastdraft.layers.norm import RMSNorm

    torch.manual_seed(0)
    norm, lin = RMSNorm(64), nn.Linear(64, 32)
    nn.init.normal_(norm.weight)
    x = torch.randn(5, 64)
    before = lin(norm(x))
    awq.fold_scales(norm, [lin], torch.rand(64) + 0.5)
    assert torch.allclose(lin(norm(x)), before, atol=1e-5)

    up, down = nn.Linear(64, 48), nn.Linear(48, 16)
    before = down(up(x))
    awq.fold_scales(up, [down], torch.rand(48) + 0.5)
    assert torch.allclose(down(up(x)), before, atol=1e-5)


def test_awq_fold_leaves_the_original_tensors_alone():
    from torch import nn

    from fastdraft.layers.norm import RMSNorm

    norm, lin = RMSNorm(64), nn.Linear(64, 32)
    nn.init.normal_(norm.weight)
    originals = [t.detach().clone() for t in (norm.weight, lin.weight)]
    shared = [norm.weight, lin.weight]  # e.g. a state dict that build_model assigned from
    awq.fold_scales(norm, [lin], torch.rand(64) + 0.5)
    assert all(torch.equal(t, o) for t, o in zip(shared, originals))


@pytest.mark.parametrize("method", ["awq", "gptq", "rtn"])
def test_quantizing_a_model_leaves_its_state_dict_unchanged(tiny_models, method):
    # The auto flow builds every candidate from one state dict, which build_model's models share.
    from fastdraft.engine.loader import load_model
    from fastdraft.models.files import build_model, load_state_dict
    from fastdraft.quant.quant_config import QuantConfig
    from fastdraft.quant.data import calibration_samples
    from fastdraft.quant.quantizer import quantize_model

    loaded = load_model(tiny_models.dir("qwen2"), dtype="fp32")
    state = load_state_dict(loaded.model_dir)
    snapshot = {k: v.clone() for k, v in state.items()}
    config = QuantConfig(method=method, group_size=32, num_calib_samples=4, calib_seq_len=32)
    model = build_model(loaded.config, state, torch.float32)
    samples = calibration_samples(loaded.tokenizer, 4, 32) if config.needs_calibration else None
    quantize_model(model, config, samples, show_progress=False)
    changed = [k for k, v in state.items() if not torch.equal(v, snapshot[k])]
    assert changed == []
