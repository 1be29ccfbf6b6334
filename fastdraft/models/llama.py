"""Llama-family decoder (Llama, SmolLM2, Qwen2) with HF parameter names.

One forward pass takes a flat batch: the new tokens of one or more sequences back to back
(``input_ids`` [num_tokens], each at its own position), writing their keys and values into a
:class:`~fastdraft.layers.kv_cache.PagedKVCache` described by
:class:`~fastdraft.layers.kv_cache.PagedAttentionMetadata`. The modules below are the
reference twin and the CUDA path; on CPUs with fastdraft's kernels the same call runs as one
C++ step (:class:`~fastdraft.models.fused_decoder.FusedDecoder`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.model_config import ModelConfig
from fastdraft.kernels.fused import is_paged_block_size, rotary, silu_and_mul
from fastdraft.layers.attention import paged_attention
from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.linear import Linear, has_hooks
from fastdraft.layers.norm import RMSNorm
from fastdraft.layers.quant_linear import EXACT_MIN_ROWS
from fastdraft.layers.rotary import RotaryEmbedding
from fastdraft.models.cuda_decoder import CudaDecoder
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
                kv_cache: PagedKVCache, meta: PagedAttentionMetadata) -> torch.Tensor:
        # hidden_states [num_rows, hidden_size] may carry padding rows after the meta.num_tokens
        # real ones (see LlamaForCausalLM.min_rows): projections see them, attention and the cache do not.
        num_rows, num_tokens = hidden_states.shape[0], meta.num_tokens
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        # [1, num_tokens, heads, head_dim]: rotary's layout
        q = q[:num_tokens].view(1, num_tokens, self.num_heads, self.head_dim)
        k = k[:num_tokens].view(1, num_tokens, self.num_kv_heads, self.head_dim)
        q = rotary(q, cos[None], sin[None])[0]  # [num_tokens, heads, head_dim]
        k = rotary(k, cos[None], sin[None])[0]
        v = v[:num_tokens].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_blocks, v_blocks = kv_cache.update(self.layer_idx, k, v, meta)
        out = paged_attention(q, k_blocks, v_blocks, meta, self.scale)  # [num_tokens, heads, head_dim]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
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
                kv_cache: PagedKVCache, meta: PagedAttentionMetadata) -> torch.Tensor:
        """hidden_states [num_rows, hidden_size], cos/sin [num_tokens, head_dim] -> [num_rows, hidden_size]."""
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, kv_cache, meta)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: PagedAttentionMetadata, min_rows: int = 1) -> torch.Tensor:
        """The module path: input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)  # [num_tokens, head_dim]
        if num_tokens < min_rows:  # zero rows stay finite through RMSNorm and are dropped below
            hidden_states = F.pad(hidden_states, (0, 0, 0, min_rows - num_tokens))
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, kv_cache, meta)
        return self.norm(hidden_states[:num_tokens])


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head. ``forward`` returns hidden states; ``compute_logits`` projects
    only the rows the caller needs (the last one of each sequence in plain decoding, k+1 rows
    in verification); ``logits`` does both, with the head inside the C++ step where it can.

    ``min_rows``: every matmul of the module path over fewer rows runs padded to exactly this
    many. A GEMM's result for one row depends on the shape it runs in, not on the other rows'
    values, so with ``min_rows = EXACT_MIN_ROWS`` a one-token decode step and a verification
    of up to that many tokens (k <= 4 drafts) give bit-identical results for the same token:
    speculative greedy decoding then reproduces plain greedy decoding exactly, in any dtype.
    Padding costs little because decoding is bound by reading the weights, which the padded
    rows share.
    """

    def __init__(self, config: ModelConfig, min_rows: int = EXACT_MIN_ROWS) -> None:
        super().__init__()
        self.config = config
        self.min_rows = min_rows
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: PagedAttentionMetadata, decoder: FusedDecoder | CudaDecoder | None = None) -> torch.Tensor:
        """One forward pass over a flat batch: input_ids, positions [num_tokens] -> final hidden
        states [num_tokens, hidden_size], every token's key and value written to ``kv_cache``.

        ``positions`` are ``meta.positions``, as vLLM's models take them. ``decoder``: a C++ step
        its caller built for this model (:meth:`fused_decoder`), the CPU backend of the same call,
        bit-identical to the module path (for the one exception see
        :mod:`~fastdraft.models.fused_decoder`), or the GPU step of
        :mod:`~fastdraft.models.cuda_decoder`; without it, the module path."""
        if decoder is not None:
            return decoder.forward_paged(input_ids, positions, kv_cache, meta)
        return self.model(input_ids, positions, kv_cache, meta, self.min_rows)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
               meta: PagedAttentionMetadata, logit_rows: list[int],
               decoder: FusedDecoder | CudaDecoder | None = None) -> torch.Tensor:
        """fp32 logits [len(logit_rows), vocab_size] of the flat batch's ``logit_rows``:
        ``compute_logits(forward(...)[logit_rows])`` bit for bit, with a weight-only head run
        inside ``decoder``'s C++ step where it can."""
        if decoder is not None and decoder.has_head:
            return decoder.logits_paged(input_ids, positions, kv_cache, meta, logit_rows)
        hidden = self(input_ids, positions, kv_cache, meta, decoder)  # [num_tokens, hidden_size]
        return self.compute_logits(hidden[logit_rows])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., hidden_size] -> fp32 logits [..., vocab_size]."""
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        num_rows = rows.shape[0]
        if num_rows < self.min_rows:
            rows = F.pad(rows, (0, 0, 0, self.min_rows - num_rows))
        logits = self.lm_head(rows)[:num_rows].float()
        return logits.view(*hidden_states.shape[:-1], -1)

    def fused_decoder(self, block_size: int = 16) -> FusedDecoder | CudaDecoder | None:
        """The fused step of this model's modules as they are now, for a paged cache of
        ``block_size``-token blocks, for the caller to own and pass to ``forward`` or ``logits``:
        the C++ step on a CPU, Triton kernels and fused matmuls on a GPU. None where neither can
        run (no CPU kernels or Triton, a block size they do not take, hooks observing the model)."""
        if has_hooks(self) or has_hooks(self.model):
            return None
        if self.device.type == "cuda":
            with torch.inference_mode():
                return CudaDecoder.build(self, block_size)
        if self.device.type != "cpu" or not is_paged_block_size(block_size):
            return None
        with torch.inference_mode():
            return FusedDecoder.build(self.model, self.lm_head, self.dtype, self.device, self.min_rows)

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
