"""The canonical INT4/INT8 formats: round-trip error bounds, packing layout, validation."""

import pytest
import torch

from fastdraft.quant.quant_config import QuantConfig, parse_quant_spec
from fastdraft.formats import (
    PER_CHANNEL,
    SUPPORTED_GROUP_SIZES,
    dequantize,
    group_params,
    pack_int4,
    pack_int6,
    quantize,
    sym_zero_point,
    unpack_int4,
    unpack_int6,
)

GROUPS = [*SUPPORTED_GROUP_SIZES, PER_CHANNEL]


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("scheme", ["sym", "asym", "asymf"])
def test_int4_round_trip_error_is_within_half_a_step(group_size, scheme):
    torch.manual_seed(0)
    w = torch.randn(48, 2048) * torch.rand(48, 1) * 3  # rows of different magnitude
    qw = quantize(w, bits=4, group_size=group_size, sym=scheme == "sym", float_zeros=scheme == "asymf")
    g = 2048 if group_size == PER_CHANNEL else group_size
    err = (dequantize(qw) - w).abs().view(48, 2048 // g, g)
    step = qw.scales.float().abs().unsqueeze(-1)  # [N, groups, 1]
    # RTN error is at most half a step, except at the range's edges: values clipped at +7
    # (symmetric) or shifted by the rounded zero point (asymmetric) are off by at most one step,
    # and by the fp16 rounding of the scale on top (up to 8 * 2**-11 of a step at the edge).
    assert torch.all(err <= step * (1 + 8 * 2**-11) + 1e-6)
    assert (err <= 0.5 * step * (1 + 1e-3) + 1e-6).float().mean() > 0.99
    # ...and it is a real quantizer: typical error is a fraction of a step, not zero.
    assert 0.15 < (err / step).mean() < 0.4


@pytest.mark.parametrize("group_size", [32, 128, PER_CHANNEL])
def test_float_zeros_keep_a_min_scale_grid_exactly(group_size):
    # A weight already on a 4-bit grid w = s * q - m per group (a Q4_K sub-block, q spanning
    # 0..15): float zeros put min and max on levels 0 and 15 and recover it to fp16 precision;
    # integer zeros must round -m / s and shift the whole group.
    torch.manual_seed(1)
    n, k = 32, 1024
    g = k if group_size == PER_CHANNEL else group_size
    # Codes spanning all 16 levels in half the groups and only 0..11 in the others.
    top = torch.where(torch.rand(n, k // g, 1) < 0.5, 15, 11)
    q = torch.floor(torch.rand(n, k // g, g) * (top + 1)).float()
    q[..., :1], q[..., 1:2] = 0, top.float()
    s = torch.rand(n, k // g, 1) * 0.02 + 0.001
    m = torch.rand(n, k // g, 1) * 15 * s
    w = (s * q - m).reshape(n, k)
    step = s.expand(-1, -1, g).reshape(n, k)
    err_float = ((dequantize(quantize(w, 4, group_size, sym=False, float_zeros=True)) - w).abs() / step).max()
    err_int = ((dequantize(quantize(w, 4, group_size, sym=False)) - w).abs() / step).mean()
    assert err_float < 0.02  # fp16 rounding of scale and zero, not quantization error
    assert err_int > 0.1
    qw = quantize(w, 4, group_size, sym=False, float_zeros=True)
    assert qw.zeros.dtype == torch.float16 and qw.has_float_zeros and not qw.is_sym


@pytest.mark.parametrize("group_size", GROUPS)
def test_int8_round_trip(group_size):
    torch.manual_seed(1)
    w = torch.randn(16, 1024)
    qw = quantize(w, bits=8, group_size=group_size, sym=True)
    assert qw.qweight.dtype == torch.int8
    rel = (dequantize(qw) - w).abs().max() / w.abs().max()
    assert rel < 1 / 127


@pytest.mark.parametrize("group_size", GROUPS)
def test_int6_round_trip_error_is_within_half_a_step(group_size):
    torch.manual_seed(3)
    w = torch.randn(16, 2048) * torch.rand(16, 1) * 3
    qw = quantize(w, bits=6, group_size=group_size, sym=True)
    assert qw.qweight.shape == (16, 1536) and qw.qweight.dtype == torch.uint8 and qw.zeros is None
    g = 2048 if group_size == PER_CHANNEL else group_size
    err = (dequantize(qw) - w).abs().view(16, 2048 // g, g)
    step = qw.scales.float().abs().unsqueeze(-1)
    # +31 clips the opposite edge by a step, give or take the fp16 scale's rounding (up to
    # 2^-11 relative, times 32 levels).
    assert torch.all(err <= step * (1 + 2e-2) + 1e-6)
    assert (err <= 0.5 * step * (1 + 1e-3) + 1e-6).float().mean() > 0.99
    assert 0.15 < (err / step).mean() < 0.4
    q = unpack_int6(qw.qweight)
    assert q.max() <= 63 and (q == 0).any()  # the largest magnitude of each group maps to -32


def test_int6_packing_layout():
    q = torch.tensor([[1, 2, 63, 0, 5, 6, 7, 8]], dtype=torch.uint8)
    packed = pack_int6(q)
    word = 1 | 2 << 6 | 63 << 12 | 0 << 18  # 4 values in a little-endian 24-bit word
    assert packed[0, :3].tolist() == [word & 0xFF, word >> 8 & 0xFF, word >> 16]
    assert torch.equal(unpack_int6(packed), q)
    with pytest.raises(ValueError, match="divisible by 4"):
        pack_int6(torch.zeros(1, 6, dtype=torch.uint8))


def test_int6_is_symmetric_only():
    with pytest.raises(ValueError, match="symmetric"):
        quantize(torch.randn(4, 64), bits=6, group_size=32, sym=False)


@pytest.mark.parametrize("kwargs", [dict(sym=False, bits=6), dict(sym=True, bits=8), dict(sym=True, bits=5)])
def test_group_params_rejects_formats_it_does_not_cover(kwargs):
    with pytest.raises(ValueError):
        group_params(torch.randn(4, 32), **kwargs)


@pytest.mark.parametrize("bits", [4, 6])
def test_symmetric_codes_centre_on_the_zero_point(bits):
    # A group's largest magnitude maps to code 0 and zero weights to the zero point.
    w = torch.tensor([[-1.0, 0.0, 0.5, 0.25] * 8])
    qw = quantize(w, bits=bits, group_size=32, sym=True)
    codes = (unpack_int4 if bits == 4 else unpack_int6)(qw.qweight)
    assert codes[0, 0] == 0 and codes[0, 1] == sym_zero_point(bits)
    with pytest.raises(ValueError):
        sym_zero_point(5)


def test_smaller_groups_are_more_accurate():
    torch.manual_seed(2)
    w = torch.randn(64, 1024)
    errors = [(dequantize(quantize(w, 4, g, sym=False)) - w).pow(2).mean().item() for g in (32, 128, 1024)]
    assert errors[0] < errors[1] < errors[2]


def test_nibble_packing_layout():
    q = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_int4(q)
    # even k -> low nibble, odd k -> high nibble
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(unpack_int4(packed), q)


def test_shapes_and_dtypes():
    w = torch.randn(8, 256)
    qw = quantize(w, 4, 64, sym=False)
    assert qw.qweight.shape == (8, 128) and qw.qweight.dtype == torch.uint8
    assert qw.scales.shape == (8, 4) and qw.scales.dtype == torch.float16
    assert qw.zeros.shape == (8, 4) and qw.zeros.dtype == torch.uint8
    assert quantize(w, 4, 64, sym=True).zeros is None


def test_symmetric_uses_the_full_signed_range():
    w = torch.tensor([[-4.0, 1.0, 2.0, 3.5] * 8])
    qw = quantize(w, 4, 32, sym=True)
    q = unpack_int4(qw.qweight)
    assert q.min().item() == 0  # the largest magnitude maps to -8 exactly
    assert dequantize(qw)[0, 0].item() == pytest.approx(-4.0, rel=1e-3)


@pytest.mark.parametrize("float_zeros", [False, True])
def test_zero_weights_do_not_divide_by_zero(float_zeros):
    qw = quantize(torch.zeros(4, 64), 4, 32, sym=False, float_zeros=float_zeros)
    assert torch.all(dequantize(qw) == 0)


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "bogus"}, "unknown quantization method"),
    ({"group_size": 100}, "group_size"),
    ({"bits": 3}, "bits"),
    ({"bits": 8, "sym": False}, "symmetric"),
    ({"method": "rtn", "act_order": True}, "act_order"),
    ({"lm_head_bits": 2}, "lm_head_bits"),
    ({"sym": True, "float_zeros": True}, "float_zeros"),
])
def test_bad_configs_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="does not divide"):
        quantize(torch.randn(4, 96), 4, 64)


def test_parse_quant_spec(tmp_path):
    config = parse_quant_spec("method=gptq,group_size=64,sym=false,act_order=true")
    assert (config.method, config.group_size, config.sym, config.act_order) == ("gptq", 64, False, True)
    with pytest.raises(ValueError):
        parse_quant_spec("group_size=abc")
    with pytest.raises(ValueError):
        parse_quant_spec("unknown_key=1")
    with pytest.raises(ValueError, match="neither an existing JSON file"):
        parse_quant_spec(str(tmp_path / "missing.json"))


def test_mixed_precision_layers_follow_llama_cpp_q4_k_m():
    # The layers Qwen2.5-Coder-1.5B-Instruct's Q4_K_M GGUF stores v_proj/down_proj at Q6_K.
    config = QuantConfig(sensitive_bits=8)
    kept = [i for i in range(28) if config.layer_format(i, 28, "mlp.down_proj").bits == 8]
    assert kept == [0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27]
    assert config.layer_format(0, 28, "self_attn.q_proj").bits == 4


def test_int8_linears_keep_those_linears_at_int8_in_every_layer():
    config = QuantConfig(group_size=32, int8_linears=("o_proj", "self_attn.v_proj", "v_proj"))
    assert config.int8_linears == ("self_attn.v_proj", "self_attn.o_proj")  # canonical names and order
    for layer_idx in range(4):
        assert config.layer_format(layer_idx, 4, "self_attn.o_proj") == (8, -1, True, False)
        assert config.layer_format(layer_idx, 4, "self_attn.v_proj").bits == 8
        assert config.layer_format(layer_idx, 4, "self_attn.q_proj") == (4, 32, True, False)
    assert parse_quant_spec("group_size=32,int8_linears=v_proj+o_proj") == config
    assert QuantConfig.from_dict(config.to_dict() | {"int8_linears": ["v_proj", "o_proj"]}) == config  # from JSON
    with pytest.raises(ValueError, match="unknown decoder linear"):
        QuantConfig(int8_linears=("w_proj",))
    with pytest.raises(ValueError, match="not a string"):
        QuantConfig(int8_linears="v_proj")
    with pytest.raises(ValueError, match="INT4"):
        QuantConfig(bits=8, group_size=-1, int8_linears=("v_proj",))


def test_labels_name_what_differs():
    assert QuantConfig(method="gptq", group_size=32, sym=False, float_zeros=True).label == "gptq-int4-g32-asymf"
    assert QuantConfig(method="gptq", damp_percent=0.1).label == "gptq-int4-g128-sym-damp0.1"
    assert QuantConfig(method="rtn", sym=False, sensitive_bits=8).label == "rtn-int4-g128-asym-mix8"
    assert QuantConfig(int8_linears=("o_proj", "v_proj")).label == "rtn-int4-g128-sym-int8[v_proj+o_proj]"
    assert QuantConfig(lm_head_bits=6).label == "rtn-int4-g128-sym-head6"


def test_int6_head_takes_the_group_size_symmetric():
    assert QuantConfig(group_size=32, sym=False, float_zeros=True, lm_head_bits=6).head_format() == (6, 32, True, False)
