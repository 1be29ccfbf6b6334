"""GGUF-native weights: each block type's codes and scales, checked against gguf's own
dequantizer (the spec), and a model that keeps its GGUF file's blocks end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from fastdraft.cli import main
from fastdraft.engine.loader import describe_weights, load_model
from fastdraft.llm import LLM
from fastdraft.formats import WeightFormat, dequantize
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.models.registry import fastdraft_home
from fastdraft.quant.checkpoint import save_quantized
from fastdraft.quant.quant_config import QuantConfig, format_spec, parse_format_spec
from fastdraft.quant.gguf_native import gguf_tensors, native_weight
from fastdraft.quant.quantizer import quantize_model
from tests.helpers import write_tiny_gguf

Q = GGMLQuantizationType


def fake_tensor(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator):
    """A ReaderTensor-like [rows, cols] weight: real quantized blocks where gguf can make them,
    else random block bytes with small, valid scales (K-quants)."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        data = gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    else:
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
        small = np.float16(rng.uniform(1e-4, 2e-3, size=(rows, cols // block_size))).view(np.uint8)
        small = small.reshape(rows, cols // block_size, 2)
        if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin lead the block
            data[..., 0:2], data[..., 2:4] = small, small[:, ::-1]
        elif qtype == Q.Q3_K:  # d ends it, after 16-bit-free bytes
            data[..., -2:] = small
            data = data.reshape(rows, -1)
            return SimpleNamespace(tensor_type=qtype, shape=np.array([cols, rows]), data=data)
        if qtype in (Q.Q4_K, Q.Q5_K):
            data[..., 0:2], data[..., 2:4] = small, small[:, ::-1]
        else:  # Q6_K: d ends it
            data[..., -2:] = small
        data = data.reshape(rows, -1)
    return SimpleNamespace(tensor_type=qtype, shape=np.array([cols, rows]), data=data)


def gguf_values(tensor) -> torch.Tensor:
    rows = int(tensor.shape[1])
    return torch.from_numpy(np.array(gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)).view(rows, -1)


@pytest.mark.parametrize("qtype,bits,fmt", [
    (Q.Q4_0, 4, "int4-g32-sym"), (Q.Q4_1, 4, "int4-g32-asymf"), (Q.Q5_0, 6, "int6-g32-sym"),
    (Q.Q8_0, 8, "int8-g32-sym"), (Q.Q4_K, 4, "int4-g32-asymf"), (Q.Q5_K, 6, "int6-g32-asymf"),
    (Q.Q6_K, 6, "int6-g16-sym")])
def test_block_types_keep_their_codes(qtype, bits, fmt):
    tensor = fake_tensor(qtype, 48, 512, np.random.default_rng(0))
    qw, is_exact = native_weight(tensor)
    assert is_exact and qw.bits == bits
    assert format_spec(WeightFormat(qw.bits, qw.group_size, qw.is_sym, qw.has_float_zeros)) == fmt
    expected = gguf_values(tensor)
    got = dequantize(qw)
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0):  # codes and fp16 scales are the file's own
        assert torch.equal(got, expected)
    else:  # the float zero point (and the K-quants' d * sc) is rounded to fp16
        g = qw.group_size
        scale = expected.abs().view(48, -1, g).amax(-1, keepdim=True).expand(-1, -1, g).reshape(48, -1)
        assert ((got - expected).abs() <= 2e-3 * scale + 1e-7).all()


def test_unsupported_block_types_are_requantized_and_said_to_be_inexact():
    tensor = fake_tensor(Q.Q3_K, 16, 512, np.random.default_rng(1))
    qw, is_exact = native_weight(tensor)
    assert not is_exact and qw.bits == 8 and qw.group_size == 32
    expected = gguf_values(tensor)
    # INT8 RTN over 32 values: within half a step of the group's absmax / 127.
    step = expected.abs().view(16, -1, 32).amax(-1, keepdim=True) / 127
    assert ((dequantize(qw) - expected).abs().view(16, -1, 32) <= step * 0.51 + 1e-7).all()


def test_float_tensors_stay_dense():
    tensor = SimpleNamespace(tensor_type=Q.F32, shape=np.array([64, 8]), data=np.zeros((8, 64), np.float32))
    assert native_weight(tensor) == (None, True)


def test_format_specs_round_trip():
    for fmt in (WeightFormat(4, 32, False, True), WeightFormat(6, 32, True), WeightFormat(8, -1, True),
                WeightFormat(4, 128, False, False)):
        assert parse_format_spec(format_spec(fmt)) == fmt
    for bad in ("int5-g32-sym", "int4-g48-sym", "int8-g32-asym", "int4/g32", "int4-g32-x"):
        with pytest.raises(ValueError):
            parse_format_spec(bad)


def _mixed_types(name: str):
    """Q4_0 for q/k (whose llama rows are permuted), Q5_0 for the MLP, Q8_0 elsewhere."""
    if "attn_q" in name or "attn_k" in name:
        return Q.Q4_0
    if "ffn" in name:
        return Q.Q5_0
    if name == "token_embd.weight":
        return Q.Q4_1
    return Q.Q8_0


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def quantized_gguf(request, tmp_path, tiny_models, tiny_tokenizer, monkeypatch):
    # Conversions land in a temporary FASTDRAFT_HOME, which shares the built CPU kernels.
    kernels = fastdraft_home() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "fastdraft_home"
    home.mkdir()
    (home / "kernels").symlink_to(kernels)
    monkeypatch.setenv("FASTDRAFT_HOME", str(home))
    variant = request.param
    path = tmp_path / f"{variant}.gguf"
    write_tiny_gguf(path, tiny_models.hf(variant), tiny_tokenizer, variant, _mixed_types)
    return path


@torch.inference_mode()
def test_a_model_keeps_its_gguf_blocks(quantized_gguf, tmp_path):
    reference = load_model(quantized_gguf, dtype="fp32", keep_gguf_quant=False)  # the dequantized file
    native = load_model(quantized_gguf, dtype="fp32", keep_gguf_quant=True)
    config = native.model.quant_config
    assert config.is_gguf_native and config.label == "gguf-native"
    formats = dict(config.tensor_formats)
    assert formats["0.self_attn.q_proj"] == "int4-g32-sym" and formats["0.mlp.up_proj"] == "int6-g32-sym"
    assert formats["0.self_attn.o_proj"] == "int8-g32-sym"
    # The reference holds the file's values rounded to bf16; the kernels quantize activations
    # to int8, and that is all that separates the logits.
    for name, module in native.model.named_modules():
        if name == "lm_head" and native.config.tie_word_embeddings:
            continue  # the Q4_1 embedding's blocks, whose fp16 zero points are not exact (tested above)
        if hasattr(module, "quantized_weight"):
            dense = reference.model.get_submodule(name).weight.float()
            assert torch.allclose(dequantize(module.quantized_weight), dense, rtol=2**-7, atol=1e-5), name
    ids = torch.tensor([reference.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    ref_logits = prompt_logits(reference.model, ids)
    native_logits = prompt_logits(native.model, ids)
    assert (native_logits - ref_logits).abs().max() < 0.1
    # (A tied head is the Q4_1 embedding: near-ties of the random model flip more often there.)
    assert (native_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() > 0.85

    # A saved checkpoint reloads with the same formats and the same logits.
    out = save_quantized(native.model, tmp_path / "native", native.model_dir)
    reloaded = load_model(out, dtype="fp32")
    assert reloaded.model.quant_config == config
    assert torch.equal(prompt_logits(reloaded.model, ids), native_logits)

    # With the reference kernel (dequantize, then an fp32 matmul) only the reference's bf16
    # rounding of the weights is left, and the fp16 zero points of the Q4_1 embedding.
    plain = load_model(quantized_gguf, dtype="fp32", keep_gguf_quant=True).model
    for module in plain.modules():
        if hasattr(module, "quantized_weight"):
            module.kernel_name = "reference"
    assert torch.allclose(prompt_logits(plain, ids), ref_logits, atol=3e-2)


def prompt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = SequenceCache.from_config(model.config, 64, dtype=torch.float32)
    input_ids, meta = cache.append(ids[0])
    return model.compute_logits(model(input_ids, meta.positions, cache.kv_cache, meta))  # [num_tokens, vocab_size]


def test_quantizing_with_method_gguf_is_refused(tiny_loaded):
    with pytest.raises(ValueError, match="keep_gguf_quant"):
        quantize_model(tiny_loaded.model, QuantConfig(method="gguf"))


def test_keep_gguf_quant_needs_a_gguf_file(llama_dir):
    with pytest.raises(ValueError, match="no GGUF blocks"):
        load_model(llama_dir, keep_gguf_quant=True)
    with pytest.raises(ValueError, match="cannot be combined"):
        load_model(llama_dir, keep_gguf_quant=True, load_in_low_bit="sym_int4")


def test_cli_generates_and_quantizes_with_the_gguf_blocks(quantized_gguf, tmp_path, capsys):
    assert main(["generate", "--model", str(quantized_gguf), "--keep-gguf-quant", "--prompt", "def",
                 "--max-tokens", "4", "--dtype", "fp32"]) == 0
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(quantized_gguf), "--quant", "method=gguf", "--output", str(out)]) == 0
    assert "saved gguf-native" in capsys.readouterr().out
    assert load_model(out).model.quant_config.is_gguf_native
    code = main(["generate", "--model", str(tmp_path), "--keep-gguf-quant", "--prompt", "x"])
    assert code == 2 and "fastdraft: error:" in capsys.readouterr().err


def test_every_front_door_runs_the_gguf_blocks_by_default(quantized_gguf, capsys):
    assert load_model(quantized_gguf, dtype="fp32").model.quant_config.is_gguf_native
    for reference in (load_model(quantized_gguf, load_in_low_bit="fp32"),
                      load_model(quantized_gguf, dtype="fp32", keep_gguf_quant=False)):
        assert getattr(reference.model, "quant_config", None) is None
        assert describe_weights(reference.model) == "float32 (dense reference)"
    llm = LLM(str(quantized_gguf), dtype="fp32", max_model_len=64, max_num_seqs=2)
    assert llm.engine.weights == "gguf-native (activations float32)"
    for flags, weights in (([], "gguf-native"), (["--load-in-low-bit", "bf16"], "bfloat16 (dense reference)")):
        assert main(["generate", "--model", str(quantized_gguf), "--prompt", "def", "--max-tokens", "2", *flags]) == 0
        assert f"[weights: {weights}" in capsys.readouterr().err


class _DenseSpy(TorchDispatchMode):
    """Records the shape of every floating-point tensor an op makes outside the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta":
                self.shapes.add(tuple(t.shape))
        return out


def test_loading_the_gguf_blocks_makes_no_dense_copy_of_a_quantized_linear(quantized_gguf):
    load_model(quantized_gguf, dtype="fp32")  # converted once, outside the spy
    with _DenseSpy() as spy:
        loaded = load_model(quantized_gguf, dtype="fp32")
    # The decoder's quantized linears (the head has the embedding table's shape, which stays dense).
    shapes = {(m.out_features, m.in_features) for m in loaded.model.model.layers.modules()
              if hasattr(m, "quantized_weight")}
    assert shapes and not shapes & spy.shapes, shapes & spy.shapes
    with _DenseSpy() as spy:  # the spy sees a dense load's weights
        load_model(quantized_gguf, dtype="fp32", keep_gguf_quant=False)
    assert shapes <= spy.shapes


def test_the_tensor_index_matches_gguf_reader(quantized_gguf):
    """The file's tensors as gguf's own reader finds them: names, types, dims and bytes."""
    from gguf import GGUFReader

    ours = gguf_tensors(quantized_gguf)
    theirs = GGUFReader(quantized_gguf).tensors
    assert list(ours) == [t.name for t in theirs]
    for tensor in theirs:
        mine = ours[tensor.name]
        assert mine.tensor_type == tensor.tensor_type and mine.shape == tuple(int(d) for d in tensor.shape)
        assert bytes(mine.data) == np.ascontiguousarray(tensor.data).view(np.uint8).tobytes(), tensor.name
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_tensors(Path(__file__))


@pytest.mark.usefixtures("each_isa")
def test_q5_k_blocks_run_on_the_cpu_kernels():
    # INT6 with float zeros (Q5_K's own codes): the kernel against its twin and the dense values.
    from fastdraft.kernels.build import load_cpu_kernels
    from fastdraft.kernels.x86 import X86WoqKernel, reference_woq_matmul

    if load_cpu_kernels() is None:
        pytest.skip("no C++ kernels")
    qw, _ = native_weight(fake_tensor(Q.Q5_K, 37, 512, np.random.default_rng(2)))
    kernel = X86WoqKernel(qw, torch.float32, torch.device("cpu"), large_m=None)
    dense = dequantize(qw)
    for m in (1, 3, 9):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        out, twin = kernel(x), reference_woq_matmul(x, qw)
        scale = twin.abs().max().item()
        assert (out.double() - twin).abs().max().item() <= 1e-5 * scale
        assert (out - x @ dense.t()).abs().max().item() <= 2e-2 * scale
