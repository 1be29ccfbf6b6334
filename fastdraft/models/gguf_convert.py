"""Convert a GGUF file into a plain HF model folder.

The folder holds ``config.json``, ``model.safetensors`` (bf16 by default), ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``. Weights are dequantized with the
``gguf`` package; the tokenizer is rebuilt from the GGUF vocabulary with ``tokenizers``.
The folder is written to a temporary sibling and renamed into place, so an interrupted
conversion never leaves a half-written model that looks good.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from fastdraft.model_config import ModelConfig
from fastdraft.models.plan import GEMMA3_LOCAL_ROPE_BASE
from fastdraft.fileio import atomic_dir

logger = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 names its norms after where they sit: "ffn_norm" is the pre-MLP norm there.
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Qwen3: Llama's tensors and a norm over each query and key head.
_QWEN3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF architecture -> (HF model_type, its layer tensor names). llama.cpp writes Mistral as
# "llama" (and no sliding window: it runs those files without one, and so does the conversion).
_ARCHS = {
    "llama": ("llama", _LAYER_TENSORS),
    "qwen2": ("qwen2", _LAYER_TENSORS),
    "qwen3": ("qwen3", _QWEN3_LAYER_TENSORS),
    "gemma3": ("gemma3_text", _GEMMA3_LAYER_TENSORS),
}

# Pre-tokenizer split patterns, keyed by GGUF ``tokenizer.ggml.pre`` (the same regexes the
# original HF tokenizer.json files use).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral-Nemo's "tekken": upper-case runs split from lower-case ones, one digit at a time.
_TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF pre-tokenizer names the byte-level rebuild knows ("default" and "gpt-2": GPT-2's regex).
BYTE_LEVEL_PRE_TOKENIZERS = ("default", "gpt-2", "qwen2", "llama-bpe", "llama3", "smollm", "tekken")

_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class GGUFError(ValueError):
    """The GGUF file is unreadable or describes something we cannot convert."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _read_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    names = {t.name for t in reader.tensors}
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    gemma = {}
    if arch == "gemma3":  # the layer pattern follows from the plan's default (every sixth global)
        gemma = dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                     sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
                     rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE)  # llama.cpp's, the file being silent
    return ModelConfig(
        rope_scaling=_rope_scaling(reader, arch, head_dim),
        model_type=_ARCHS[arch][0],
        vocab_size=int(embed.shape[1]) if tokens is None else max(len(tokens), int(embed.shape[1])),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_eos_token_ids(reader),
        torch_dtype="bfloat16",
        **gemma,
    )


def _rope_scaling(reader: Any, arch: str, head_dim: int) -> dict[str, Any] | None:
    """The HF ``rope_scaling`` of a GGUF's rotary: ``{arch}.rope.scaling.*`` for linear and YaRN,
    or Llama 3's per-frequency divisors (the ``rope_freqs.weight`` tensor llama.cpp computes from
    ``factor``, ``low_freq_factor``, ``high_freq_factor`` and the original context), turned back
    into an equivalent ``llama3`` scaling."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(_field(reader, f"{arch}.rope.scaling.original_context_length"))}
        for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                          ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"{arch}.rope.scaling.{key}")
            if value is not None:
                scaling[name] = float(value)
        return scaling
    if kind not in (None, "none"):
        raise GGUFError(f"unsupported GGUF rope scaling {kind!r}; supported: linear, yarn, and Llama 3's rope_freqs")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return _llama3_scaling(np.asarray(freqs.data, dtype=np.float64).reshape(-1),
                           float(_field(reader, f"{arch}.rope.freq_base", 10000.0)), head_dim)


def _llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The ``llama3`` scaling whose divisors of the frequencies are ``divisors`` [head_dim / 2]:
    1 for short wavelengths, ``factor`` for long ones, and between them 1 / ((1 - s) / factor +
    s) with s linear in 1 / wavelength. Only the ratios of the original context to the two
    frequency factors matter, so ``low_freq_factor`` is taken as 1."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(divisors.max())
    if factor <= 1.0:
        raise GGUFError("rope_freqs.weight scales no frequency; not Llama 3's scaling")
    medium = (divisors > 1.0 + 1e-6) & (divisors < factor - 1e-6)
    if medium.sum() < 2:
        raise GGUFError("rope_freqs.weight has too few smoothed frequencies to recover Llama 3's scaling")
    smooth = (1.0 / divisors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)  # s = a / wavelength + b
    a, b = np.polyfit(1.0 / wavelen[medium], smooth, 1)
    high_freq_factor = 1.0 - 1.0 / b
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": float(high_freq_factor), "original_max_position_embeddings": float(-a / b)}


# Control tokens that end a generation even when the GGUF names another EOS; the same list
# llama.cpp uses to find "end of generation" tokens (e.g. Qwen's <|endoftext|> beside <|im_end|>).
_END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")


def _eos_token_ids(reader: Any) -> list[int] | None:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    token_types = _field(reader, "tokenizer.ggml.token_type") or []
    for idx, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind == _TOKEN_TYPE_CONTROL and text in _END_OF_GENERATION_TEXTS and idx not in ids:
            ids.append(idx)
    return ids or None


def unpermute_llama(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp applies to Q/K of ``llama`` models for its RoPE."""
    dim = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def _hf_name(gguf_name: str, layer_tensors: dict[str, str]) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in layer_tensors:
            return f"model.layers.{idx}.{layer_tensors[rest]}"
    return None


def _convert_tensors(reader: Any, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    tensors: dict[str, torch.Tensor] = {}
    layer_tensors = _ARCHS[_field(reader, "general.architecture")][1]
    # llama.cpp's converter stores Gemma's norm weights w as 1 + w (its norm multiplies by them).
    norm_offset = 1.0 if config.model_type == "gemma3_text" else 0.0
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", leave=False):
        name = _hf_name(t.name, layer_tensors)
        if name is None:
            if t.name == "rope_freqs.weight":
                continue
            raise GGUFError(f"unexpected tensor {t.name!r} in GGUF file")
        array = dequantize(t.data, t.tensor_type)
        # gguf lists dims fastest-first; numpy data is already [rows, cols] = [out, in].
        array = array.reshape([int(d) for d in reversed(t.shape)] if len(t.shape) > 1 else [int(t.shape[0])])
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = unpermute_llama(array, heads)
        array = np.array(array, dtype=np.float32)  # a copy: the memmap is read-only
        if norm_offset and name.endswith("norm.weight"):
            array -= norm_offset
        tensors[name] = torch.from_numpy(array).to(dtype)
    embed = tensors["model.embed_tokens.weight"]
    if embed.shape[0] < config.vocab_size:
        raise GGUFError("embedding has fewer rows than the vocabulary")
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def build_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """Rebuild an HF ``tokenizers.Tokenizer`` and its tokenizer_config from GGUF metadata."""
    from tokenizers import AddedToken

    kind = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if kind == "llama":
        tokenizer = _sentencepiece_tokenizer(reader, tokens, token_types)
    elif kind == "gpt2":
        tokenizer = _byte_level_tokenizer(reader, tokens)
    else:
        raise GGUFError(f"unsupported GGUF tokenizer model {kind!r}; implemented: byte-level BPE ('gpt2') "
                        "and SentencePiece ('llama')")
    added = [AddedToken(tok, special=(kind_ == _TOKEN_TYPE_CONTROL), normalized=False)
             for tok, kind_ in zip(tokens, token_types)
             if kind_ in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tokenizer.add_tokens(added)

    def token_at(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tokenizer, tokenizer_config


def _sentencepiece_tokenizer(reader: Any, tokens: list[str], token_types: list[int]) -> Any:
    """A SentencePiece BPE vocabulary (pieces with scores, ``▁`` for a space, byte fallback) as
    a ``tokenizers`` BPE. SentencePiece merges the adjacent pair whose joined piece scores
    highest, over the whole text (llama.cpp does the same): the merges are every split of a
    piece into two pieces of the vocabulary, ranked by the joined piece's score."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(_field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for i in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        if token_types[i] != _TOKEN_TYPE_NORMAL:
            continue  # control, byte and unused pieces are never the result of a merge
        splits = [(piece[:j], piece[j:]) for j in range(1, len(piece)) if piece[:j] in vocab and piece[j:] in vocab]
        merges += sorted(splits, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                     unk_token=None if unk_id is None else tokens[int(unk_id)],
                                     fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    normalize = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        normalize.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(normalize)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _byte_level_tokenizer(reader: Any, tokens: list[str]) -> Any:
    """A byte-level BPE (GPT-2 style: Qwen, Llama 3, SmolLM) from its merges and pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in ("llama-bpe", "llama3", "tekken"):
        pattern = _TEKKEN_PATTERN if pre == "tekken" else _LLAMA3_PATTERN
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in ("default", "gpt-2"):
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # another split would tokenize text differently from the model's training: refused
        raise GGUFError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(BYTE_LEVEL_PRE_TOKENIZERS)}")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantize ``gguf_path`` into an HF folder at ``out_dir`` (atomically). Returns ``out_dir``."""
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises assorted errors on corrupt input
        raise GGUFError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    config = _read_config(reader)
    tensors = _convert_tensors(reader, config, dtype)
    tokenizer, tokenizer_config = build_tokenizer(reader)
    config.torch_dtype = str(dtype).removeprefix("torch.")

    with atomic_dir(out_dir) as tmp_dir:
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        (tmp_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        (tmp_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        generation_config = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        (tmp_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    logger.info("converted %s -> %s", gguf_path, out_dir)
    return out_dir
