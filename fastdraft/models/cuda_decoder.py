"""The CUDA step: a decoder plan executed on a GPU in few launches, the CUDA backend of the forward pass.

A small model's decode step on a GPU is bound by kernel launches, not by bytes: the module path
runs about forty launches a layer (RMSNorm alone is seven, rotary ten). :class:`CudaDecoder`
runs the same computation over a flat batch of paged sequences in about ten a layer: the q/k/v
and gate/up projections as one matmul each (``layers/linear.py::fused_linear``), the residual
add fused into the next RMSNorm, rotary in place by position, and SiLU-and-multiply, each one
Triton launch (``kernels/triton_ops.py``), with the KV write and the paged attention of
``kernels/triton_attention.py``. It allocates nothing that depends on the step's contents, only
on its shape, and never reads a device value on the host, so a CUDA graph can capture it
(``engine/cuda_graphs.py``). The module path in ``causal_lm.py`` is its reference twin (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.kernels import triton_attention, triton_ops
from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.linear import fused_linear
from fastdraft.models.plan import LayerPlan


class _Projections:
    """Linears that read one input, as one fused matmul where they fuse, else one by one."""

    def __init__(self, linears: list[nn.Module], dtype: torch.dtype, device: torch.device) -> None:
        self.fused = fused_linear(linears, dtype, device)
        self.linears = linears

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([linear(x) for linear in self.linears], dim=-1)


class _Layer:
    def __init__(self, plan: LayerPlan, layer: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        attn, mlp, spec = layer.self_attn, layer.mlp, plan.attention
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = spec.scale
        self.qkv = _Projections([attn.q_proj, attn.k_proj, attn.v_proj], dtype, device)
        self.o_proj = attn.o_proj
        self.gate_up = _Projections([mlp.gate_proj, mlp.up_proj], dtype, device)
        self.down_proj = mlp.down_proj
        self.input_norm = getattr(layer, plan.pre_attention_norm.name)
        self.post_norm = getattr(layer, plan.pre_mlp_norm.name)
        # Qwen3's RMSNorm over each query and key head, before rotary (None: not in the plan).
        self.q_norm = getattr(attn, spec.q_norm.name) if spec.q_norm is not None else None
        self.k_norm = getattr(attn, spec.k_norm.name) if spec.k_norm is not None else None


class CudaDecoder:
    """A ``CausalLM``'s decoder on a GPU: embedding, layers and final norm in Triton kernels and
    fused matmuls; the LM head stays the model's (``has_head`` is False).

    Built from the modules as they are at that moment (``CausalLM.fused_decoder``) and owned by
    whoever built it; dense projections are re-pointed at slices of their fused weight, so no
    weight is held twice."""

    NAME = "the CUDA step"
    # The plan's features beyond the plain Llama layer that this executor runs (models/plan.py).
    IMPLEMENTS = frozenset({"embedding_scale", "final_logit_softcap", "qk_norm"})
    has_head = False

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, min_rows: int) -> None:
        decoder = model.model
        self.embed, self.rotary, self.norm = decoder.embed, decoder.rotary_emb, decoder.norm
        self.layers = [_Layer(plan, layer, dtype, device) for plan, layer in zip(decoder.plan.layers, decoder.layers)]
        self.dtype, self.device, self.min_rows = dtype, device, min_rows

    @classmethod
    def build(cls, model: nn.Module, block_size: int) -> "CudaDecoder | None":
        """The CUDA step of ``model`` (a ``CausalLM`` on a GPU whose plan it implements), or None
        where it cannot run: no Triton, or a cache block size or head size the Triton attention
        does not take."""
        head_dim = model.plan.layers[0].attention.head_dim
        if not (triton_ops.is_available() and model.device.type == "cuda"):
            return None
        if block_size % triton_attention.MIN_TILE_ROWS or head_dim < triton_attention.MIN_TILE_ROWS or head_dim % 2:
            return None
        return cls(model, model.dtype, model.device, model.min_rows)

    def reserve(self, max_seq_len: int) -> None:
        """Build the rotary tables for positions below ``max_seq_len`` now: a CUDA graph captures
        the tables' addresses, so they must not grow after capture."""
        self.rotary.tables(max_seq_len, self.dtype, self.device)

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                      meta: PagedAttentionMetadata) -> torch.Tensor:
        """A flat batch: input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        device_meta = meta.int32_tensors()
        hidden = self.run(input_ids, positions, meta.slot_mapping, device_meta.block_tables, device_meta.seq_lens,
                          device_meta.query_start_loc, meta.max_context_len, kv_cache)
        return hidden[:meta.num_tokens]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_seq_len: int,
            kv_cache: PagedKVCache) -> torch.Tensor:
        """The pass over device tensors: input_ids, positions, slot_mapping [num_tokens] (slot -1:
        not written), and the int32 block_tables [num_seqs, max_blocks], seq_lens [num_seqs],
        query_start_loc [num_seqs + 1]; ``max_seq_len`` bounds seq_lens. Returns the final
        hidden states [max(num_tokens, min_rows), hidden_size], of which the first num_tokens
        rows are the tokens' (the rest pad every matmul to ``min_rows`` rows)."""
        num_tokens = input_ids.shape[0]
        num_rows = max(num_tokens, self.min_rows)
        if num_rows > num_tokens:
            input_ids = F.pad(input_ids, (0, num_rows - num_tokens))
        cos, sin = self.rotary.tables(max_seq_len, self.dtype, self.device)  # [>= max_seq_len, head_dim]
        residual = self.embed(input_ids)  # [num_rows, hidden_size]
        first = self.layers[0].input_norm if self.layers else self.norm
        hidden = triton_ops.triton_rms_norm(residual, first.weight, first.eps)
        # Attention writes the tokens' rows of one buffer every layer; padding rows stay zero, so
        # every row the matmuls see is finite (each row's result depends on that row alone).
        attn = None
        for i, layer in enumerate(self.layers):
            heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
            qkv = layer.qkv(hidden)  # [num_rows, (heads + 2 * kv_heads) * head_dim]
            q_and_k = qkv[:num_tokens, :(heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)
            for norm, part in ((layer.q_norm, q_and_k[:, :heads]), (layer.k_norm, q_and_k[:, heads:])):
                if norm is not None:  # each head's rows normed, written back in place
                    rows = part.reshape(-1, dim).contiguous()  # [num_tokens * heads, head_dim]
                    part.copy_(triton_ops.triton_rms_norm(rows, norm.weight, norm.eps).view(part.shape))
            triton_ops.rotary_(q_and_k, positions, cos, sin)
            v = qkv[:num_tokens, (heads + kv_heads) * dim:].view(num_tokens, kv_heads, dim)
            k_layer, v_layer = kv_cache.k[i], kv_cache.v[i]
            triton_attention.write_kv(q_and_k[:, heads:], v, k_layer, v_layer, slot_mapping)
            if attn is None or attn.shape[1:] != (heads, dim):
                attn = (torch.empty if num_rows == num_tokens else torch.zeros)(num_rows, heads, dim, dtype=qkv.dtype,
                                                                                device=qkv.device)
            triton_attention.triton_paged_attention(q_and_k[:, :heads], k_layer, v_layer, block_tables, seq_lens,
                                             query_start_loc, max_seq_len, layer.scale, out=attn[:num_tokens])
            out = layer.o_proj(attn.view(num_rows, heads * dim))  # [num_rows, hidden_size]
            hidden = triton_ops.triton_rms_norm(out, layer.post_norm.weight, layer.post_norm.eps, residual=residual)
            out = layer.down_proj(triton_ops.triton_silu_and_mul(layer.gate_up(hidden)))
            norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            hidden = triton_ops.triton_rms_norm(out, norm.weight, norm.eps, residual=residual)
        return hidden
