"""Llama-family decoder (Llama, SmolLM2, Qwen2) with HF parameter names.

One forward pass takes a batch of sequences, each at its own positions, and writes their
keys/values into a :class:`~fastdraft.layers.kv_cache.KVCache` described by
:class:`~fastdraft.layers.kv_cache.AttentionMetadata`.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.config import ModelConfig
from fastdraft.kernels.fused import rotary, silu_and_mul
from fastdraft.layers.attention import cached_attention
from fastdraft.layers.kv_cache import AttentionMetadata, KVCache, PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.linear import Linear, has_hooks
from fastdraft.layers.norm import RMSNorm
from fastdraft.layers.quant_linear import EXACT_MIN_ROWS, QuantLinear
from fastdraft.layers.rotary import RotaryEmbedding
from fastdraft.models.fused_decoder import FusedDecoder


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # hidden_states may carry padding rows after the meta.num_tokens real ones (see
        # LlamaModel.min_rows): projections see them, attention and the cache do not.
        batch, num_rows, _ = hidden_states.shape
        num_tokens = meta.num_tokens
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        # [batch, num_tokens, heads, head_dim]
        q = q[:, :num_tokens].view(batch, num_tokens, self.num_heads, self.head_dim)
        k = k[:, :num_tokens].view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        v = v[:, :num_tokens].view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        # -> [batch, heads, num_tokens, head_dim]
        q = rotary(q, cos, sin).transpose(1, 2)
        k = rotary(k, cos, sin).transpose(1, 2)
        k_all, v_all = kv_cache.update(self.layer_idx, k, v.transpose(1, 2), meta)
        out = cached_attention(q, k_all, v_all, meta, self.scale)
        out = out.transpose(1, 2).reshape(batch, num_tokens, self.num_heads * self.head_dim)
        if num_rows > num_tokens:
            out = F.pad(out, (0, 0, 0, num_rows - num_tokens))
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [..., 2 * intermediate_size]
        return self.down_proj(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, meta)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                min_rows: int = 1, decoder: FusedDecoder | None = None) -> torch.Tensor:
        if decoder is not None and isinstance(meta, PagedAttentionMetadata):
            return self.forward_paged(input_ids, kv_cache, meta, decoder)
        return self.forward_to(input_ids, kv_cache, meta, min_rows, decoder)[0]

    def forward_paged(self, input_ids: torch.Tensor, kv_cache: PagedKVCache, meta: PagedAttentionMetadata,
                      decoder: FusedDecoder, head=None, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """A flat batch [1, num_tokens] over a paged cache, every layer and the final norm in
        ``decoder``'s one C++ call -> final hidden states [1, num_tokens, hidden_size]; with a
        weight-only ``head`` op (which needs the norm inside), the fp32 logits of
        ``logit_rows`` [n] instead, [n, vocab_size]."""
        hidden_states = self.embed_tokens(input_ids)[0]  # [num_tokens, hidden_size]
        cos, sin = self.rotary_emb(meta.positions, hidden_states.dtype)  # [1, num_tokens, head_dim]
        norm = decoder.norm_args(self.norm)
        out = decoder.forward_paged(hidden_states, cos[0], sin[0], kv_cache, meta, norm, head, logit_rows)
        if head is not None:
            return out
        return (out if norm is not None else self.norm(out)).unsqueeze(0)

    def step_logits(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                    lm_head: nn.Module, num_logit_rows: int, decoder: FusedDecoder | None) -> torch.Tensor | None:
        """fp32 logits [num_logit_rows, vocab] of a decode or verification step run in
        ``decoder``'s one C++ call from the token ids on (``FusedDecoder.logits``), or None
        when it cannot run there."""
        if decoder is None or not decoder.accepts(kv_cache, meta):
            return None
        return decoder.logits(input_ids, kv_cache, meta, self.embed_tokens, self.rotary_emb, self.norm, lm_head,
                              num_logit_rows)

    def forward_to(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, min_rows: int = 1,
                   decoder: FusedDecoder | None = None, lm_head: nn.Module | None = None,
                   num_logit_rows: int = 0) -> tuple[torch.Tensor, bool]:
        """-> (final hidden states [batch, num_tokens, hidden_size], False); or, given
        ``lm_head``, when ``decoder`` can run it too (a decode or verification step), (its
        output for the last ``num_logit_rows`` tokens [rows, out_features] in the activation
        dtype, True)."""
        hidden_states = self.embed_tokens(input_ids)  # [batch, num_tokens, hidden_size]
        num_tokens = hidden_states.shape[1]
        cos, sin = self.rotary_emb(meta.positions, hidden_states.dtype)  # [batch, num_tokens, head_dim]
        fused = decoder if decoder is not None and decoder.accepts(kv_cache, meta) else None
        if fused is not None:
            norm = fused.norm_args(self.norm)
            head = fused.head_op(lm_head) if norm is not None and lm_head is not None else None
            out = fused.forward(hidden_states[0], cos[0], sin[0], kv_cache, meta, norm, head, num_logit_rows)
            if head is not None:
                return out, True
            return (out.unsqueeze(0) if norm is not None else self.norm(out.unsqueeze(0))), False
        if num_tokens < min_rows:  # zero rows stay finite through RMSNorm and are dropped below
            hidden_states = F.pad(hidden_states, (0, 0, 0, min_rows - num_tokens))
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, kv_cache, meta)
        return self.norm(hidden_states[:, :num_tokens]), False


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head. ``forward`` returns hidden states; ``compute_logits`` projects
    only the rows the caller needs (the last one in plain decoding, k+1 rows in verification).

    ``min_rows``: every matmul over fewer rows runs padded to exactly this many. A GEMM's
    result for one row depends on the shape it runs in, not on the other rows' values, so
    with ``min_rows = EXACT_MIN_ROWS`` a one-token decode step and a verification of up to
    that many tokens (k <= 4 drafts) give bit-identical results for the same token:
    speculative greedy decoding then reproduces plain greedy decoding exactly, in any dtype.
    Padding costs little because decoding is bound by reading the weights (~3-5% for 5 rows,
    5-12% for 8).
    """

    def __init__(self, config: ModelConfig, min_rows: int = EXACT_MIN_ROWS) -> None:
        super().__init__()
        self.config = config
        self.min_rows = min_rows
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                decoder: FusedDecoder | None = None) -> torch.Tensor:
        """input_ids [batch, num_tokens] -> hidden states [batch, num_tokens, hidden_size].

        ``decoder``: a fused decoder its caller built for this model (the engine's runner), to
        run a paged flat batch in one C++ call; without it, or for other metadata, the module
        path."""
        return self.model(input_ids, kv_cache, meta, self.min_rows, decoder)

    def paged_logits(self, input_ids: torch.Tensor, kv_cache: PagedKVCache, meta: PagedAttentionMetadata,
                     decoder: FusedDecoder, logit_rows: list[int]) -> torch.Tensor | None:
        """fp32 logits [len(logit_rows), vocab_size] of a paged flat batch [1, num_tokens], the
        layers, the final norm and a weight-only LM head in ``decoder``'s one C++ call:
        ``compute_logits(forward(...)[0, logit_rows])``, bit for bit. None when the head or the
        norm cannot run there."""
        is_inside = decoder.is_weight_only and decoder.is_fusable_norm(self.model.norm)
        head = decoder.head_op(self.lm_head) if is_inside and isinstance(self.lm_head, QuantLinear) else None
        if head is None:
            return None
        return self.model.forward_paged(input_ids, kv_cache, meta, decoder, head,
                                        torch.tensor(logit_rows, dtype=torch.long))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., hidden_size] -> fp32 logits [..., vocab_size]."""
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        num_rows = rows.shape[0]
        if num_rows < self.min_rows:
            rows = F.pad(rows, (0, 0, 0, self.min_rows - num_rows))
        logits = self.lm_head(rows)[:num_rows].float()
        return logits.view(*hidden_states.shape[:-1], -1)

    def fused_decoder(self) -> FusedDecoder | None:
        """A C++ decoder of this model's layers as they are now, for the caller to own and pass
        to ``forward`` or ``decode_logits``; None where it cannot run (off the CPU kernels, on
        CUDA, with hooks observing the model)."""
        if self.device.type != "cpu" or has_hooks(self) or has_hooks(self.model):
            return None
        with torch.inference_mode():
            return FusedDecoder.build(self.model.layers, self.dtype, self.device, self.min_rows)

    def decode_logits(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                      num_logit_rows: int | None = None, decoder: FusedDecoder | None = None) -> torch.Tensor:
        """fp32 logits [num_logit_rows, vocab_size] of the last rows (default: all) of a
        batch-1 pass: ``compute_logits(forward(...))``, bit for bit; with the caller's
        ``decoder`` (:meth:`fused_decoder`), decode and verification steps run as one C++ call
        with the LM head inside the decoder's region."""
        num_tokens = input_ids.shape[1]
        rows = num_tokens if num_logit_rows is None else num_logit_rows
        if input_ids.shape[0] != 1 or not 1 <= rows <= num_tokens:
            raise ValueError(f"decode_logits takes one sequence and 1..{num_tokens} logit rows, got "
                             f"batch {input_ids.shape[0]} and {rows} rows")
        if has_hooks(self) or has_hooks(self.model):  # observed calls go through forward
            return self.compute_logits(self(input_ids, kv_cache, meta)[0, num_tokens - rows:])
        logits = self.model.step_logits(input_ids, kv_cache, meta, self.lm_head, rows, decoder)
        if logits is not None:
            return logits
        out, is_logits = self.model.forward_to(input_ids, kv_cache, meta, self.min_rows, decoder, self.lm_head, rows)
        if is_logits:
            return out.float()
        return self.compute_logits(out[0, num_tokens - rows:])

    def decode_weight_bytes(self) -> int:
        """Bytes of weights read per decode step: every parameter and buffer once, except the
        embedding table, of which one row is read (unless the LM head shares it)."""
        embed, head = self.model.embed_tokens, self.lm_head
        embed_ptrs = {t.data_ptr() for t in itertools.chain(embed.parameters(), embed.buffers())}
        head_ptrs = {t.data_ptr() for t in itertools.chain(head.parameters(), head.buffers())}
        seen, total = set(), 0
        for t in itertools.chain(self.parameters(), self.buffers()):
            ptr = t.data_ptr()
            if ptr in seen or (ptr in embed_ptrs and ptr not in head_ptrs):
                continue
            seen.add(ptr)
            total += t.numel() * t.element_size()
        return total

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype (the final norm is never quantized)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device
