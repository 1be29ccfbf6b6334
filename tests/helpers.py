"""Builders shared by the tests: a tiny byte-level BPE tokenizer, tiny random HF models
saved as HF folders, tiny GGUF files written the way llama.cpp's converter writes them, a
model's pass over a SequenceCache, and a live ``fastdraft serve`` app on a loopback port.

The server's packages (and httpx) are imported inside the functions that use them: the model
tests import this module on machines that have none of them."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.layers.kv_cache import PagedAttentionMetadata, SequenceCache, Span, flat_batch

# The same split regex as Qwen2's tokenizer.json (and fastdraft's GGUF "qwen2" pre-tokenizer).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    # Tools as Qwen2.5's template lists them (so that tool calls parse in the Hermes format).
    "{% if tools %}{{ '<|im_start|>system\\nCall a tool: <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>\\n' }}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|endoftext|>",
    "eos_token": "<|im_end|>",
    "add_bos_token": False,
    "chat_template": CHAT_TEMPLATE,
}
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "import numpy as np\nimport torch\n",
    "class Model:\n    def __init__(self):\n        self.layers = []\n",
    "the cat sat on the mat and the dog sat on the log",
    "speculative decoding drafts tokens and verifies them in one pass",
] * 4
TOKENIZER_VOCAB_SIZE = 320


# The split patterns of Llama 3's and Mistral-Nemo's (tekken) tokenizer.json files.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                  r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tiny_tokenizer(pattern: str | None = None) -> Any:
    """A byte-level BPE trained on a tiny corpus: Qwen2's (NFC, Qwen2 split regex, byte-level),
    or with ``pattern``, a split regex of another family's and no normalizer (Llama 3, tekken)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    if pattern is None:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern or QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def tokenizer_merges(tok: Any) -> list[str]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_tokenizer_files(tok: Any, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))


# Tiny architectures: hidden 64, 4 heads (head_dim 16), vocab = the tiny tokenizer's.
def _common(vocab_size: int) -> dict[str, Any]:
    return dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=vocab_size, max_position_embeddings=1024, rms_norm_eps=1e-6,
                initializer_range=0.1, bos_token_id=0, eos_token_id=2)


VARIANTS = ("llama", "llama_tied", "llama3_rope", "qwen2")
# A tiny Llama (Qwen2 for yarn) per rotary scaling kind.
ROPE_SCALING_VARIANTS = {
    "rope_linear": {"rope_type": "linear", "factor": 2.0},
    "rope_dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "rope_yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def build_hf_model(variant: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random fp32 HF model; norms and biases are randomized too so mistakes in them show."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = _common(vocab_size)
    if variant == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw, num_hidden_layers=2, tie_word_embeddings=False))
    elif variant == "llama_tied":
        # Plain multi-head attention (no GQA) and tied embeddings.
        kw["num_key_value_heads"] = 4
        model = LlamaForCausalLM(LlamaConfig(**kw, num_hidden_layers=3, tie_word_embeddings=True,
                                             rope_theta=500000.0))
    elif variant == "llama3_rope":
        # theta and the original context are chosen so that all three llama3 frequency bands
        # (kept, smoothed, stretched) occur at head_dim 16.
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        model = LlamaForCausalLM(LlamaConfig(**kw, num_hidden_layers=2, rope_theta=100.0,
                                             tie_word_embeddings=False))
    elif variant == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw, num_hidden_layers=3, rope_theta=1e6,
                                             tie_word_embeddings=False, use_sliding_window=False))
    elif variant == "qwen3":
        # Per-head q/k norms; a head size (32) that is not hidden / heads (16); a tied head.
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=32, num_hidden_layers=2, rope_theta=1e6,
                                             tie_word_embeddings=True, attention_bias=False))
    elif variant in ("mistral", "mistral_nemo"):
        # mistral: every layer over a window of 16 keys; mistral_nemo: no window, a head size of
        # its own.
        from transformers import MistralConfig, MistralForCausalLM

        extra = dict(sliding_window=16) if variant == "mistral" else dict(sliding_window=None, head_dim=32)
        model = MistralForCausalLM(MistralConfig(**kw, **extra, num_hidden_layers=2, tie_word_embeddings=False))
    elif variant in ROPE_SCALING_VARIANTS:
        # Llama (Qwen2 for yarn) with each rotary scaling, over an original context of 64 that
        # a 200-token text passes.
        from transformers import LlamaConfig, LlamaForCausalLM

        scaling = ROPE_SCALING_VARIANTS[variant]
        if variant == "rope_yarn":
            kw["max_position_embeddings"] = 256  # the original 64 times the factor
            model = Qwen2ForCausalLM(Qwen2Config(**kw, num_hidden_layers=2, rope_theta=1e4, rope_scaling=scaling,
                                                 tie_word_embeddings=False, use_sliding_window=False))
        else:
            kw["max_position_embeddings"] = 64 if variant == "rope_dynamic" else kw["max_position_embeddings"]
            model = LlamaForCausalLM(LlamaConfig(**kw, num_hidden_layers=2, rope_scaling=scaling,
                                                 tie_word_embeddings=False))
    elif variant in ("gemma3", "gemma3_w32"):
        # Five local layers (a window of 8) to a global one, each kind its own rotary base; a
        # head dim and attention scale of their own. gemma3_w32: a window of 32 over two blocks
        # of 16, and one block of a layer's keys a whole 4 KiB page (fp32), so that a block's
        # memory can be released alone.
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        window, head_dim = (8, 32) if variant == "gemma3" else (32, 64)
        kw.update(num_key_value_heads=1, head_dim=head_dim, query_pre_attn_scalar=24, sliding_window=window,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        model = Gemma3ForCausalLM(Gemma3TextConfig(**kw, num_hidden_layers=6, tie_word_embeddings=True))
    else:
        raise ValueError(variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and variant.startswith("gemma3"):
                p.copy_(0.3 * torch.randn_like(p))  # Gemma's norms scale by 1 + weight
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model.float().eval()


# ---------------------------------------------------------------------------------------------
# GGUF


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The Q/K row permutation llama.cpp's convert_hf_to_gguf.py applies to llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(rope: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight`` for a
    ``llama3`` rotary scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def write_tiny_gguf(path: Path, hf_model: torch.nn.Module, tok: Any, arch: str, quant_types: Any = None,
                    pre: str = "qwen2") -> None:
    """Write ``hf_model`` (F32 tensors) and ``tok`` into a GGUF file like llama.cpp does.

    ``quant_types``: a function of the GGUF tensor name giving the ``GGMLQuantizationType``
    its 2-D weight is quantized to (with ``gguf.quants.quantize``), or None for F32."""
    import gguf

    cfg = hf_model.config
    tied = bool(cfg.tie_word_embeddings)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_theta = rope.get("rope_theta") or cfg.rope_theta
    w.add_rope_freq_base(float(rope_theta))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    # Rotary scaling as llama.cpp's converter writes it: metadata for linear and YaRN, a tensor
    # of per-frequency divisors for Llama 3's.
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(rope, float(rope_theta), head_dim))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    token_types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(tokenizer_merges(tok))
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if tied:
                continue
            gname = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{_GGUF_LAYER_NAMES[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, cfg.num_key_value_heads)
        qtype = quant_types(gname) if quant_types is not None and array.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gname, array)
        else:
            w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_tokens_equal_one_token_calls(out: torch.Tensor, attend_one, q: torch.Tensor, k: torch.Tensor,
                                        v: torch.Tensor, num_tokens: int) -> None:
    """``out`` [B, H, num_tokens * group, D] is attention of ``num_tokens`` token-major query
    groups whose last token is key ``k.shape[2] - 1``. Each token's rows must equal, bit for
    bit, ``attend_one(q_t, k_t, v_t)`` over that token's own prefix: what speculative
    verification needs to reproduce plain one-token decoding."""
    group, length = q.shape[2] // num_tokens, k.shape[2]
    for t in range(num_tokens):
        visible = length - num_tokens + t + 1
        rows = slice(t * group, (t + 1) * group)
        one = attend_one(q[:, :, rows].contiguous(), k[:, :, :visible], v[:, :, :visible])
        assert torch.equal(out[:, :, rows], one), f"token {t} differs from its one-token call"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paged_batch(requests: list[tuple[list[int], int, int, list[int]]],
                block_size: int) -> tuple[torch.Tensor, PagedAttentionMetadata, list[int]]:
    """One flat step over hand-placed blocks. Each request is (its token ids, the first position
    computed in this step, how many, its block table). Returns (input ids [num_tokens], the
    metadata, query_start_loc)."""
    spans = [Span(tokens[start:start + num_new], start, table) for tokens, start, num_new, table in requests]
    ids, meta = flat_batch(spans, block_size, "cpu")
    return ids, meta, meta.query_start_loc


def append_pass(model, cache: SequenceCache, ids: list[int] | torch.Tensor, decoder=None,
                logit_rows: list[int] | None = None) -> torch.Tensor:
    """Append ``ids`` to ``cache`` and run them through ``model`` (the module path, or
    ``decoder``'s C++ step): hidden states [num_tokens, hidden_size], or with ``logit_rows``
    (indices into the appended tokens) their fp32 logits [len(logit_rows), vocab_size] from
    ``model.logits``."""
    input_ids, meta = cache.append(ids)
    if logit_rows is None:
        return model(input_ids, meta.positions, cache.kv_cache, meta, decoder)
    return model.logits(input_ids, meta.positions, cache.kv_cache, meta, logit_rows, decoder)


def wait_healthy(url: str, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200."""
    import httpx  # a test dependency the model tests do without (see LiveServer)

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the server at {url} did not become ready")


class LiveServer:
    """The app under uvicorn on a thread, on a free loopback port; ``speculation``: the engine's
    speculator factory (``fastdraft.speculative.factory.speculator_factory(config)``), or None."""

    def __init__(self, loaded, engine_config: EngineConfig, model_name: str, speculation=None,
                 **server_config) -> None:
        # Imported here, not at the top: the model tests (and a GPU machine with no server
        # packages) need the other helpers without the server's dependencies.
        import uvicorn

        from fastdraft.server.app import ServerConfig, build_fastapi_app

        self.engine: LLMEngine | None = None

        def load() -> LLMEngine:
            self.engine = LLMEngine(loaded, engine_config, speculation=speculation)
            return self.engine

        app = build_fastapi_app(load, ServerConfig(served_model_name=model_name, **server_config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.url, 60)

    def client(self, api_key: str = "none") -> "openai.OpenAI":  # noqa: F821
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 30
        while self.engine.has_unfinished_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # aborts submitted by the event loop land between steps
