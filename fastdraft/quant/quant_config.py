"""Quantization configuration, validated, and serialized as ``quant_config.json``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from fastdraft.formats import PER_CHANNEL, SUPPORTED_GROUP_SIZES, WeightFormat

METHODS = ("rtn", "gptq", "awq")
# Not a quantization method: the weights keep a GGUF file's own blocks (quant/gguf_native.py).
GGUF_METHOD = "gguf"

# The linears of a decoder layer, by HF name, grouped by the input they share.
ATTN_INPUT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_INPUT = ("mlp.gate_proj", "mlp.up_proj")
LAYER_LINEARS = (*ATTN_INPUT, "self_attn.o_proj", *MLP_INPUT, "mlp.down_proj")
SENSITIVE_LINEARS = ("self_attn.v_proj", "mlp.down_proj")


def _full_linear_name(name: str) -> str:
    """``"v_proj"`` or ``"self_attn.v_proj"`` -> ``"self_attn.v_proj"``; ValueError if unknown."""
    for full in LAYER_LINEARS:
        if name in (full, full.rpartition(".")[2]):
            return full
    raise ValueError(f"unknown decoder linear {name!r}; choose from {', '.join(LAYER_LINEARS)}")


def split_plus_list(text: str) -> tuple[str, ...]:
    """``"v_proj+o_proj"`` -> ``("v_proj", "o_proj")``: how list values are written in a spec."""
    return tuple(item.strip() for item in text.split("+") if item.strip())


def _q4_k_m_more_bits(layer_idx: int, num_layers: int) -> bool:
    """The layers whose v_proj/down_proj llama.cpp's Q4_K_M keeps at 6 bits.

    llama.cpp applies ``use_more_bits(i) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` to the
    i-th such tensor in file order, and a GGUF converted from HF stores tensors in name order
    (blk.0, blk.1, blk.10, blk.11, ...): the rule's i is the rank of the layer's name, not its
    index. (Checked against Qwen2.5-Coder-1.5B-Instruct's Q4_K_M file: Q6_K in exactly layers
    0, 1, 5-10, 13, 16, 19, 21, 24, 27.)"""
    rank = sorted(range(num_layers), key=str).index(layer_idx)
    eighth = num_layers // 8
    return rank < eighth or rank >= 7 * num_layers // 8 or (rank - eighth) % 3 == 2


def format_spec(fmt: WeightFormat) -> str:
    """``WeightFormat(4, 32, False, True)`` -> ``"int4-g32-asymf"``."""
    group = "pc" if fmt.group_size == PER_CHANNEL else f"g{fmt.group_size}"
    kind = "sym" if fmt.sym else ("asymf" if fmt.float_zeros else "asym")
    return f"int{fmt.bits}-{group}-{kind}"


def parse_format_spec(spec: str) -> WeightFormat:
    """The inverse of :func:`format_spec`; ``ValueError`` for anything else."""
    parts = spec.split("-")
    kinds = {"sym": (True, False), "asym": (False, False), "asymf": (False, True)}
    try:
        bits_text, group_text, kind = parts
        bits = int(bits_text.removeprefix("int")) if bits_text.startswith("int") else -1
        group = PER_CHANNEL if group_text == "pc" else int(group_text.removeprefix("g"))
        sym, float_zeros = kinds[kind]
    except (ValueError, KeyError):
        raise ValueError(f"bad weight format {spec!r}; expected e.g. int4-g32-asymf") from None
    if bits not in (4, 6, 8) or (group != PER_CHANNEL and group not in SUPPORTED_GROUP_SIZES) or \
            (not sym and bits != 4 and not (bits == 6 and float_zeros)):
        raise ValueError(f"unsupported weight format {spec!r}")
    return WeightFormat(bits, group, sym, float_zeros)


# ipex-llm's ``load_in_low_bit`` names.
LOW_BIT_NAMES = ("sym_int4", "asym_int4", "int8", "bf16", "fp32")


@dataclass
class QuantConfig:
    """How to quantize a model's linear layers (weight-only).

    ``lm_head_bits`` / ``embed_bits`` keep those tensors at 8 bits (INT8 per channel) or 16
    (unquantized); they are the largest single tensors and the most sensitive. ``lm_head_bits=4``
    quantizes the head like the decoder linears (``group_size``, ``sym``): for drafts, whose
    head is up to 40% of the bytes they read per token and whose errors only cost acceptance.
    ``lm_head_bits=6`` stores it as symmetric INT6 with ``group_size`` (llama.cpp keeps a
    Q4_K_M model's output at Q6_K): 0.8 of INT8's bytes at g32, for a small accuracy cost.
    """

    method: str = "rtn"
    bits: int = 4  # 4, 6 (symmetric, RTN; 4 values in 3 bytes) or 8 (symmetric)
    group_size: int = 128  # 16..1024, or -1 for per channel
    sym: bool = True
    # Asymmetric INT4 only: fractional float16 zero points (llama.cpp Q4_1/Q4_K, ipex-llm
    # asym_int4) instead of integers 0..15 (GPTQ/AWQ checkpoints); see formats.py.
    float_zeros: bool = False
    act_order: bool = False  # GPTQ only: quantize columns by decreasing Hessian diagonal
    damp_percent: float = 0.01  # GPTQ: diagonal dampening, fraction of mean(diag(H))
    # AWQ: also search a per-group clipping range after scaling. Off by default: on
    # Qwen2.5-Coder-0.5B it lowered each layer's calibration error yet raised the held-out
    # perplexity loss (a few rare tokens lose their weight outliers).
    awq_clip: bool = False
    lm_head_bits: int = 8
    embed_bits: int = 16
    # 8: keep v_proj and down_proj of the layers llama.cpp's Q4_K_M gives more bits (the first
    # and last eighth, and every third layer between) at INT8 per channel; 4: no exception.
    sensitive_bits: int = 4
    # Decoder linears kept at INT8 per channel in every layer ("v_proj" or "self_attn.v_proj"),
    # a mixed-precision fallback for the tensors whose INT4 error costs the most accuracy per
    # byte. On Qwen2.5-Coder-0.5B, v_proj and o_proj are 2% of the bytes and a far larger share
    # of the loss.
    int8_linears: tuple[str, ...] = ()
    num_calib_samples: int = 64
    calib_seq_len: int = 512
    seed: int = 0
    # method="gguf" only: each quantized tensor's format, as read from the GGUF file
    # (("0.self_attn.q_proj", "int4-g32-asymf"), ..., ("lm_head", "int8-g32-sym")); a linear not
    # listed stays dense. Empty until the file is read.
    tensor_formats: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.method not in (*METHODS, GGUF_METHOD):
            raise ValueError(f"unknown quantization method {self.method!r}; choose from "
                             f"{', '.join((*METHODS, GGUF_METHOD))}")
        self.tensor_formats = tuple((str(name), str(spec)) for name, spec in self.tensor_formats)
        if self.tensor_formats and self.method != GGUF_METHOD:
            raise ValueError("tensor_formats applies to method=gguf only")
        for _, spec in self.tensor_formats:
            parse_format_spec(spec)
        if self.bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8, got {self.bits}")
        if self.group_size != PER_CHANNEL and self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} or -1 (per channel), "
                             f"got {self.group_size}")
        if self.bits in (6, 8) and not self.sym:
            raise ValueError(f"INT{self.bits} weight-only quantization is symmetric only")
        if self.bits == 6 and self.method != "rtn":
            raise ValueError("INT6 linears are quantized with RTN only")
        if self.float_zeros and (self.sym or self.bits != 4):
            raise ValueError("float_zeros applies to asymmetric INT4 only (sym=false, bits=4)")
        if self.act_order and self.method != "gptq":
            raise ValueError("act_order applies to GPTQ only")
        if self.awq_clip and self.method != "awq":
            raise ValueError("awq_clip applies to AWQ only")
        if not 0.0 <= self.damp_percent < 1.0:
            raise ValueError(f"damp_percent must be in [0, 1), got {self.damp_percent}")
        if isinstance(self.int8_linears, str):
            raise ValueError("int8_linears must be a sequence of linear names, not a string")
        full_names = {_full_linear_name(name) for name in self.int8_linears}
        self.int8_linears = tuple(n for n in LAYER_LINEARS if n in full_names)  # canonical order, no repeats
        if self.int8_linears and self.bits != 4:
            raise ValueError("int8_linears applies to INT4 configs only")
        if self.sensitive_bits not in (4, 8):
            raise ValueError(f"sensitive_bits must be 4 or 8, got {self.sensitive_bits}")
        if self.lm_head_bits not in (4, 6, 8, 16):
            raise ValueError(f"lm_head_bits must be 4, 6, 8 or 16, got {self.lm_head_bits}")
        if self.embed_bits not in (8, 16):
            raise ValueError(f"embed_bits must be 8 or 16, got {self.embed_bits}")
        if self.num_calib_samples < 1 or self.calib_seq_len < 8:
            raise ValueError("num_calib_samples must be >= 1 and calib_seq_len >= 8")

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("gptq", "awq")

    @property
    def is_gguf_native(self) -> bool:
        return self.method == GGUF_METHOD

    @classmethod
    def from_tensor_formats(cls, formats: dict[str, WeightFormat]) -> "QuantConfig":
        """A ``method="gguf"`` config recording the format of each quantized tensor."""
        return cls(method=GGUF_METHOD, tensor_formats=tuple((name, format_spec(fmt)) for name, fmt in formats.items()))

    def _tensor_format(self, name: str) -> WeightFormat | None:
        if not self.tensor_formats:
            raise ValueError("a method=gguf config gets its tensor formats from the GGUF file; none were read")
        spec = dict(self.tensor_formats).get(name)
        return None if spec is None else parse_format_spec(spec)

    @property
    def label(self) -> str:
        if self.is_gguf_native:
            return "gguf-native"
        extra = ("-actorder" if self.act_order else "") + ("-clip" if self.awq_clip else "")
        extra += f"-damp{self.damp_percent:g}" if self.method == "gptq" and self.damp_percent != 0.01 else ""
        extra += "-mix8" if self.sensitive_bits == 8 else ""
        extra += f"-head{self.lm_head_bits}" if self.lm_head_bits in (4, 6) else ""
        if self.int8_linears:
            extra += "-int8[" + "+".join(n.rpartition(".")[2] for n in self.int8_linears) + "]"
        return f"{self.method}-{format_spec(WeightFormat(self.bits, self.group_size, self.sym, self.float_zeros))}{extra}"

    def layer_format(self, layer_idx: int, num_layers: int, name: str) -> WeightFormat | None:
        """The format of linear ``name`` of decoder layer ``layer_idx`` (None: it stays dense)."""
        if self.is_gguf_native:
            return self._tensor_format(f"{layer_idx}.{name}")
        if name in self.int8_linears:
            return WeightFormat(8, PER_CHANNEL, True)
        if self.sensitive_bits == 8 and name in SENSITIVE_LINEARS and _q4_k_m_more_bits(layer_idx, num_layers):
            return WeightFormat(8, PER_CHANNEL, True)
        return WeightFormat(self.bits, self.group_size, self.sym, self.float_zeros)

    def embedding_format(self) -> WeightFormat | None:
        """The token embedding's format, or None to keep it unquantized."""
        if self.is_gguf_native:
            return self._tensor_format("embed_tokens")
        return WeightFormat(8, PER_CHANNEL, True) if self.embed_bits == 8 else None

    def head_format(self) -> WeightFormat | None:
        """The LM head's format, or None to keep it unquantized."""
        if self.is_gguf_native:
            return self._tensor_format("lm_head")
        if self.lm_head_bits == 16:
            return None
        if self.lm_head_bits == 8:
            return WeightFormat(8, PER_CHANNEL, True)
        if self.lm_head_bits == 6:
            return WeightFormat(6, self.group_size, True)
        return WeightFormat(4, self.group_size, self.sym, self.float_zeros)

    @classmethod
    def from_low_bit(cls, name: str, group_size: int = 32) -> "QuantConfig":
        """Config for ipex-llm style ``load_in_low_bit`` names (RTN, quantized on the fly).

        As in ipex-llm, ``sym_int4``/``asym_int4`` use blocks of 32 (like llama.cpp Q4_0/Q4_1),
        and ``asym_int4`` stores float zero points, as Q4_1 stores a float minimum."""
        if name == "sym_int4":
            return cls(method="rtn", bits=4, group_size=group_size, sym=True)
        if name == "asym_int4":
            return cls(method="rtn", bits=4, group_size=group_size, sym=False, float_zeros=True)
        if name == "int8":
            return cls(method="rtn", bits=8, group_size=PER_CHANNEL, sym=True)
        raise ValueError(f"{name!r} is not a quantized low-bit format; choose from sym_int4, asym_int4, int8")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QuantConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown quantization config keys: {sorted(unknown)}")
        return cls(**raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "QuantConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read quantization config {path}: {exc}") from exc
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_quant_spec(spec: str) -> QuantConfig:
    """A QuantConfig from a JSON file path or ``key=value,...``.

    E.g. ``method=gptq,group_size=64,sym=false``; list values are joined with ``+``
    (``int8_linears=v_proj+o_proj``)."""
    if Path(spec).is_file():
        return QuantConfig.from_file(spec)
    if "=" not in spec:
        raise ValueError(f"quantization spec {spec!r} is neither an existing JSON file nor key=value items")
    raw: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(QuantConfig)}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"bad quantization spec item {item!r}; expected key=value with key in {sorted(types)}")
        if types[key] in (bool, "bool"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} must be true or false, got {value!r}")
            raw[key] = value.lower() in ("true", "1")
        elif types[key] in (int, "int"):
            try:
                raw[key] = int(value)
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {value!r}") from None
        elif types[key] in (float, "float"):
            try:
                raw[key] = float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        elif str(types[key]).startswith("tuple"):
            raw[key] = split_plus_list(value)
        else:
            raw[key] = value
    return QuantConfig.from_dict(raw)
