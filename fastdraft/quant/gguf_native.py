"""GGUF-native weights: a GGUF file's quantized blocks held in fastdraft's formats as they are.

The known models ship as GGUF files that are already 4-6 bit, and the reference model is
their dequantized copy. Re-quantizing that copy stacks a second rounding error on the first;
keeping the file's own codes and scales does not. Each GGUF block type maps to the smallest
fastdraft format (``formats.py``) that holds its values:

========  ==========================  =====================================================
GGUF      fastdraft                   values
========  ==========================  =====================================================
Q4_0      INT4 g32, symmetric         exact: ``d * (q - 8)``
Q4_1      INT4 g32, float zeros       codes and scale exact; zero ``-m / d`` rounded to fp16
Q4_K      INT4 g32, float zeros       codes exact; the 32-weight sub-block's scale ``d * sc``
                                      and zero ``dmin * m / (d * sc)`` rounded to fp16
Q5_0      INT6 g32, symmetric         exact: ``q6 = q5 + 16`` with the block's scale
Q5_K      INT6 g32, float zeros       codes exact; the 32-weight sub-block's scale ``d * sc``
                                      and zero ``dmin * m / (d * sc)`` rounded to fp16
Q6_K      INT6 g16, symmetric         codes exact; the 16-weight sub-block's scale ``d * sc``
                                      rounded to fp16
Q8_0      INT8 g32, symmetric         exact
other     INT8 g32, symmetric         not exact: requantized (RTN) from the dequantized
                                      values, with a warning
========  ==========================  =====================================================

Float tensors (norms, biases, F16/F32 weights) stay dense. A quantized token embedding keeps
its blocks (:class:`~fastdraft.layers.quant_linear.QuantEmbedding`): a step dequantizes only
the rows it looks up.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fastdraft.formats import SCALE_DTYPE, QuantizedWeight, WeightFormat, pack_int4, pack_int6, quantize
from fastdraft.layers.quant_linear import QuantEmbedding, QuantLinear, exact_min_rows
from fastdraft.models.gguf_convert import unpermute_llama
from fastdraft.models.causal_lm import CausalLM
from fastdraft.quant.quant_config import LAYER_LINEARS, QuantConfig
from fastdraft.quant.quantizer import quant_linear, replace_module

logger = logging.getLogger(__name__)

GROUP = 32
# HF linear name (after "model.layers.N.") -> GGUF tensor name (after "blk.N.").
_GGUF_LINEARS = {
    "self_attn.q_proj": "attn_q.weight", "self_attn.k_proj": "attn_k.weight", "self_attn.v_proj": "attn_v.weight",
    "self_attn.o_proj": "attn_output.weight", "mlp.gate_proj": "ffn_gate.weight", "mlp.up_proj": "ffn_up.weight",
    "mlp.down_proj": "ffn_down.weight",
}
# GGML tensor types by name: ``gguf`` is imported only where a file is read, so that importing
# fastdraft (a GPU host, say) does not need it.
_FLOAT_TYPES = ("F32", "F16", "BF16")


# GGUF metadata value types -> their size in bytes (8: a string, 9: an array, sized as read).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its name, GGML type, dims (GGUF order: ``shape[0]`` is the row
    length) and its bytes, a read-only view of the mapped file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [num_bytes]


def gguf_tensors(path: str | Path) -> dict[str, GgufTensor]:
    """The tensors of the GGUF file ``path`` by name, over one read-only map of the file.

    The metadata (a tokenizer's 150k strings among it) is skipped, not parsed: gguf's own
    reader turns every value into numpy views, which takes seconds for a model's vocabulary."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    pos, alignment = 24, 32

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + length]).decode("utf-8", errors="replace"), at + 8 + length

    def skip(value_type: int, at: int) -> int:
        if value_type == _GGUF_STRING:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if value_type == _GGUF_ARRAY:
            item_type, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item_type in _SCALAR_BYTES:
                return at + count * _SCALAR_BYTES[item_type]
            for _ in range(count):
                at = skip(item_type, at)
            return at
        return at + _SCALAR_BYTES[value_type]

    for _ in range(num_kv):
        key, pos = string(pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, pos + 4)
        pos = skip(value_type, pos + 4)
    infos = []
    for _ in range(num_tensors):
        name, pos = string(pos)
        (num_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        infos.append((name, GGMLQuantizationType(type_id), tuple(int(d) for d in dims), offset))
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, tensor_type, dims, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_bytes = int(np.prod(dims)) // block_size * type_size
        tensors[name] = GgufTensor(name, tensor_type, dims, raw[start + offset:start + offset + num_bytes])
    return tensors


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """[rows, bytes per row] tensor data as uint8 [rows, blocks per row, block_bytes]."""
    return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ([..., 2] uint8) as float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, axis: int = -1) -> np.ndarray:
    """GGUF's nibble order: every low nibble of ``qs``, then every high one, along ``axis``."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=axis)


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _q4_0(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    d = _f16(blocks[..., 0:2])  # [rows, num_blocks]
    qs = blocks[..., 2:18]  # low nibbles: weights 0-15; high nibbles: weights 16-31
    q = _nibbles(qs).reshape(rows, -1)
    return QuantizedWeight(pack_int4(_tensor(q, torch.uint8)), _tensor(d, SCALE_DTYPE), None, 4, GROUP,
                           num_blocks * GROUP)


def _q4_1(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    qs = blocks[..., 4:20]
    q = _nibbles(qs).reshape(rows, -1)
    return _float_zero_weight(q, d, m, num_blocks * GROUP)


def _float_zero_weight(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, in_features: int,
                       bits: int = 4) -> QuantizedWeight:
    """INT4 (or INT6) with float zeros for groups whose values are ``scale * q + offset``."""
    is_constant = scale == 0  # every value of the group is ``offset``: code 0 with zero -offset / scale
    if is_constant.any():
        q = q.reshape(*scale.shape, GROUP).copy()
        q[is_constant] = 0
        q = q.reshape(scale.shape[0], -1)
        scale = np.where(is_constant, np.where(offset == 0, 1.0, np.abs(offset)), scale)
    scale = scale.astype(np.float16).astype(np.float32)  # the zero point is taken against the stored scale
    zero = -offset / scale
    if not np.isfinite(zero.astype(np.float16)).all():
        raise ValueError("a zero point of this GGUF tensor does not fit float16")
    pack = pack_int4 if bits == 4 else pack_int6
    return QuantizedWeight(pack(_tensor(q, torch.uint8)), _tensor(scale, SCALE_DTYPE),
                           _tensor(zero, SCALE_DTYPE), bits, GROUP, in_features)


def _q4_k(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, num_blocks]
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [rows * num_blocks, 8] each
    sc = sc.reshape(rows, num_blocks, 8).astype(np.float32)
    m = m.reshape(rows, num_blocks, 8).astype(np.float32)
    # 4 chunks of 32 bytes: the low nibbles are sub-block 2c, the high nibbles sub-block 2c + 1.
    qs = blocks[..., 16:144].reshape(rows, num_blocks, 4, 1, 32)
    q = _nibbles(qs, axis=3).reshape(rows, -1)
    scale = (d[..., None] * sc).reshape(rows, -1)  # [rows, num_groups]
    offset = -(dmin[..., None] * m).reshape(rows, -1)
    return _float_zero_weight(q, scale, offset, num_blocks * 256)


def _q5_k(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    # 256 weights: d, dmin, 12 bytes of 6-bit sub-block scales and mins (as Q4_K's), 32 bytes of
    # 5th bits, 128 of low nibbles.
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, num_blocks]
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(rows, num_blocks, 8).astype(np.float32)
    m = m.reshape(rows, num_blocks, 8).astype(np.float32)
    qh = blocks[..., 16:48].reshape(rows, num_blocks, 1, 32)
    # 4 chunks of 32 bytes: the low nibbles are sub-block 2c (5th bit: qh bit 2c), the high
    # nibbles sub-block 2c + 1 (qh bit 2c + 1).
    low = _nibbles(blocks[..., 48:176].reshape(rows, num_blocks, 4, 1, 32), axis=3)  # [rows, blocks, 4, 2, 32]
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [rows, blocks, 8, 32]: sub-block j's bits
    q = (low.reshape(rows, num_blocks, 8, 32) | (high << 4)).reshape(rows, -1)
    scale = (d[..., None] * sc).reshape(rows, -1)
    offset = -(dmin[..., None] * m).reshape(rows, -1)
    return _float_zero_weight(q, scale, offset, num_blocks * 256, bits=6)


def _q5_0(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    d = _f16(blocks[..., 0:2])
    qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [rows, num_blocks, 1]: bit i is weight i's 5th bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, num_blocks, 32]
    qs = blocks[..., 6:22]
    low = _nibbles(qs)
    q6 = (low | (high << 4)) + 16  # Q5_0's d * (q5 - 16) is INT6's scale * (q6 - 32)
    return QuantizedWeight(pack_int6(_tensor(q6.reshape(rows, -1), torch.uint8)), _tensor(d, SCALE_DTYPE), None,
                           6, GROUP, num_blocks * GROUP)


def _q6_k(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    # 256 weights: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 sub-block scales, d.
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, num_blocks, 16]
    d = _f16(blocks[..., 208:210])  # [rows, num_blocks]
    # Two halves of 128 weights: ql's 64 bytes give weights 0-63 (low nibbles, then high), and
    # qh's 32 bytes their bits 4-5, in four 2-bit fields for weights 0-31, 32-63, 64-95, 96-127.
    low = _nibbles(ql.reshape(rows, num_blocks, 2, 1, 64), axis=3).reshape(rows, num_blocks, 2, 4, 32)
    high = (qh.reshape(rows, num_blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q6 = (low | (high << 4)).reshape(rows, -1)  # d * sc * (q - 32) is INT6's scale * (q6 - 32)
    scale = (d[..., None] * sc).reshape(rows, -1)  # [rows, num_blocks * 16]
    return QuantizedWeight(pack_int6(_tensor(q6, torch.uint8)), _tensor(scale, SCALE_DTYPE), None, 6, 16,
                           num_blocks * 256)


def _q8_0(blocks: np.ndarray) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows, -1)
    return QuantizedWeight(_tensor(q, torch.int8), _tensor(d, SCALE_DTYPE), None, 8, GROUP, num_blocks * GROUP)


_EXACT = {  # GGML type -> (bytes of a block, its converter)
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q4_K": (144, _q4_k),
    "Q5_0": (22, _q5_0),
    "Q5_K": (176, _q5_k),
    "Q6_K": (210, _q6_k),
    "Q8_0": (34, _q8_0),
}


def native_weight(tensor, num_heads: int | None = None) -> tuple[QuantizedWeight | None, bool]:
    """The GGUF ``tensor`` (a ``gguf.ReaderTensor`` of a 2-D weight) in a fastdraft format:
    ``(weight, is_exact)``, or ``(None, True)`` for a float tensor, which stays dense.

    ``num_heads``: undo llama.cpp's RoPE row permutation of a ``llama`` model's Q/K weight."""
    type_name = tensor.tensor_type.name
    if type_name in _FLOAT_TYPES:
        return None, True
    rows = int(tensor.shape[1])
    if type_name in _EXACT:
        block_bytes, convert = _EXACT[type_name]
        qw, is_exact = convert(_blocks(tensor.data, rows, block_bytes)), True
    else:
        from gguf.quants import dequantize

        dense = dequantize(tensor.data, tensor.tensor_type).reshape(rows, -1)
        qw, is_exact = quantize(torch.from_numpy(np.array(dense, dtype=np.float32)), bits=8, group_size=GROUP), False
    if num_heads is not None:
        qw = _permute_rows(qw, num_heads)
    return qw, is_exact


def _permute_rows(qw: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    order = torch.from_numpy(unpermute_llama(np.arange(qw.out_features), num_heads))
    zeros = None if qw.zeros is None else qw.zeros[order]
    return QuantizedWeight(qw.qweight[order], qw.scales[order], zeros, qw.bits, qw.group_size, qw.in_features)


def weight_format(qw: QuantizedWeight) -> WeightFormat:
    return WeightFormat(qw.bits, qw.group_size, qw.is_sym, qw.has_float_zeros)


def has_native_weights(gguf_path: str | Path) -> bool:
    """Whether the file holds any quantized weight to keep."""
    return any(t.tensor_type.name not in _FLOAT_TYPES for t in gguf_tensors(gguf_path).values())


@torch.inference_mode()
def apply_gguf_native(model: CausalLM, gguf_path: str | Path) -> QuantConfig:
    """Replace ``model``'s decoder linears and LM head with the quantized blocks of
    ``gguf_path``, the file the model was converted from, and return the config that records
    each tensor's format (``method="gguf"``; saved checkpoints reload from it)."""
    tensors = gguf_tensors(gguf_path)
    config = model.config
    formats: dict[str, WeightFormat] = {}
    inexact: dict[str, int] = {}

    def take(gguf_name: str, linear: nn.Module, num_heads: int | None = None) -> QuantLinear | None:
        if gguf_name not in tensors:
            raise ValueError(f"{gguf_path} has no tensor {gguf_name!r}; is it the file this model came from?")
        tensor = tensors[gguf_name]
        qw, is_exact = native_weight(tensor, num_heads)
        if qw is None:
            return None
        if (qw.out_features, qw.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(f"{gguf_name} is {qw.out_features}x{qw.in_features} in {gguf_path}, "
                             f"the model's is {linear.out_features}x{linear.in_features}")
        if not is_exact:
            inexact[tensor.tensor_type.name] = inexact.get(tensor.tensor_type.name, 0) + 1
        return quant_linear(linear, qw)

    is_permuted = config.model_type == "llama"
    for idx, layer in enumerate(model.model.layers):
        for name in LAYER_LINEARS:
            heads = None
            if is_permuted and name in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if name == "self_attn.q_proj" else config.num_key_value_heads
            module = take(f"blk.{idx}.{_GGUF_LINEARS[name]}", layer.get_submodule(name), heads)
            if module is not None:
                replace_module(layer, name, module)
                formats[f"{idx}.{name}"] = weight_format(module.quantized_weight)
    # The embedding keeps the file's blocks too: a step reads a few of its rows, and a dense
    # copy would be the largest tensor in memory.
    embedding, _ = native_weight(tensors["token_embd.weight"])
    if embedding is not None:
        model.model.embed_tokens = QuantEmbedding(embedding)
        formats["embed_tokens"] = weight_format(embedding)
    # A tied head reads the embedding's blocks, as llama.cpp does.
    head = take("output.weight" if "output.weight" in tensors else "token_embd.weight", model.lm_head)
    if head is not None:
        model.lm_head = head
        formats["lm_head"] = weight_format(head.quantized_weight)
    for type_name, count in inexact.items():
        logger.warning("%s: %d %s tensors have no exact fastdraft format; held at INT8 g32 (requantized)",
                       Path(gguf_path).name, count, type_name)
    quant_config = QuantConfig.from_tensor_formats(formats)
    model.quant_config = quant_config
    if model.device.type != "meta":  # a model still being built gets it once its weights are in place
        model.min_rows = exact_min_rows(model)
    return quant_config
