"""The module path: a :class:`~fastdraft.models.plan.DecoderPlan` run as PyTorch modules with HF
parameter names. It is the reference every other executor is tested against, and where hooks
live.

One forward pass takes a flat batch: the new tokens of one or more sequences back to back
(``input_ids`` [num_tokens], each at its own position), writing their keys and values into a
:class:`~fastdraft.layers.kv_cache.PagedKVCache` described by
:class:`~fastdraft.layers.kv_cache.PagedAttentionMetadata`. :meth:`CausalLM.fused_decoder`
builds the executor that runs the same plan faster: the C++ step on a CPU, the CUDA step on a GPU.
"""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.kernels.fused import rotary
from fastdraft.kernels.ops.activation_ops import activation, gated_activation
from fastdraft.kernels.ops.attention_ops import paged_attention
from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.linear import Linear, has_hooks
from fastdraft.layers.norm import RMSNorm
from fastdraft.layers.quant_linear import EXACT_MIN_ROWS
from fastdraft.layers.rotary import RotaryEmbedding
from fastdraft.model_config import ModelConfig
from fastdraft.models.cuda_decoder import CudaDecoder
from fastdraft.models.fused_decoder import FusedDecoder
from fastdraft.models.plan import AttentionSpec, DecoderPlan, LayerPlan, MlpSpec, NormSpec, RotarySpec, decoder_plan

logger = logging.getLogger(__name__)

# An executor of a plan faster than the module path: the C++ step or the CUDA step.
DecoderStep = FusedDecoder | CudaDecoder
# Each distinct rotary of a plan -> its (cos, sin) rows [num_tokens, rotary_dim] for one pass.
RotaryRows = dict[RotarySpec, tuple[torch.Tensor, torch.Tensor]]


def _norm(spec: NormSpec | None, size: int) -> RMSNorm | None:
    return None if spec is None else RMSNorm(size, spec.eps, spec.is_offset)


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, hidden_size: int, layer_idx: int) -> None:
        super().__init__()
        self.spec, self.layer_idx = spec, layer_idx
        heads, kv_heads, dim, bias = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.has_qkv_bias
        self.q_proj = Linear(hidden_size, heads * dim, bias=bias)
        self.k_proj = Linear(hidden_size, kv_heads * dim, bias=bias)
        self.v_proj = Linear(hidden_size, kv_heads * dim, bias=bias)
        self.o_proj = Linear(heads * dim, hidden_size, bias=False)
        for norm in (spec.q_norm, spec.k_norm):
            if norm is not None:
                self.add_module(norm.name, _norm(norm, dim))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [1, num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], the first
        rotary_dim dimensions of each head rotated."""
        rotary_dim = self.spec.rotary.rotary_dim
        if rotary_dim == x.shape[-1]:
            return rotary(x, cos[None], sin[None])[0]
        rotated = rotary(x[..., :rotary_dim], cos[None], sin[None])
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)[0]

    def forward(self, hidden_states: torch.Tensor, rotary_rows: RotaryRows, kv_cache: PagedKVCache,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        # hidden_states [num_rows, hidden_size] may carry padding rows after the meta.num_tokens
        # real ones (see CausalLM.min_rows): projections see them, attention and the cache do not.
        spec = self.spec
        num_rows, num_tokens = hidden_states.shape[0], meta.num_tokens
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        # [1, num_tokens, heads, head_dim]: rotary's layout
        q = q[:num_tokens].view(1, num_tokens, spec.num_heads, spec.head_dim)
        k = k[:num_tokens].view(1, num_tokens, spec.num_kv_heads, spec.head_dim)
        if spec.q_norm is not None:
            q = getattr(self, spec.q_norm.name)(q)
        if spec.k_norm is not None:
            k = getattr(self, spec.k_norm.name)(k)
        cos, sin = rotary_rows[spec.rotary]
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)  # [num_tokens, heads, head_dim]
        v = v[:num_tokens].view(num_tokens, spec.num_kv_heads, spec.head_dim)
        k_blocks, v_blocks = kv_cache.update(self.layer_idx, k, v, meta)
        out = paged_attention(q, k_blocks, v_blocks, meta, spec.scale, spec.sliding_window, spec.logit_softcap)
        out = out.reshape(num_tokens, spec.num_heads * spec.head_dim)
        if num_rows > num_tokens:
            out = F.pad(out, (0, 0, 0, num_rows - num_tokens))
        return self.o_proj(out)


class Mlp(nn.Module):
    def __init__(self, spec: MlpSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        if spec.is_gated:
            self.gate_proj = Linear(hidden_size, spec.intermediate_size, bias=spec.has_bias)
        self.up_proj = Linear(hidden_size, spec.intermediate_size, bias=spec.has_bias)
        self.down_proj = Linear(spec.intermediate_size, hidden_size, bias=spec.has_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.spec.is_gated:
            return self.down_proj(activation(self.up_proj(x), self.spec.activation))
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [..., 2 * intermediate_size]
        return self.down_proj(gated_activation(gate_up, self.spec.activation))


class DecoderLayer(nn.Module):
    """``h += post_attn(attn(pre_attn(h)))``, then ``h += post_mlp(mlp(pre_mlp(h)))``; each norm
    a module under its HF name (the plan's), absent where the plan has none."""

    def __init__(self, plan: LayerPlan, hidden_size: int, layer_idx: int) -> None:
        super().__init__()
        self.plan = plan
        self.self_attn = Attention(plan.attention, hidden_size, layer_idx)
        self.mlp = Mlp(plan.mlp, hidden_size)
        for spec in plan.norms():
            self.add_module(spec.name, _norm(spec, hidden_size))

    def _normed(self, spec: NormSpec | None, x: torch.Tensor) -> torch.Tensor:
        return x if spec is None else getattr(self, spec.name)(x)

    def forward(self, hidden_states: torch.Tensor, rotary_rows: RotaryRows, kv_cache: PagedKVCache,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        """hidden_states [num_rows, hidden_size] -> [num_rows, hidden_size]."""
        plan = self.plan
        out = self.self_attn(self._normed(plan.pre_attention_norm, hidden_states), rotary_rows, kv_cache, meta)
        hidden_states = hidden_states + self._normed(plan.post_attention_norm, out)
        out = self.mlp(self._normed(plan.pre_mlp_norm, hidden_states))
        return hidden_states + self._normed(plan.post_mlp_norm, out)


class DecoderModel(nn.Module):
    def __init__(self, plan: DecoderPlan) -> None:
        super().__init__()
        self.plan = plan
        # The default initialisation, skipped on the meta device: there ``normal_`` goes through
        # torch's reference ops, whose first use imports TorchDynamo (over a second).
        weight = torch.empty(plan.vocab_size, plan.hidden_size)  # [vocab_size, hidden_size]
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(plan.vocab_size, plan.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(layer, plan.hidden_size, i) for i, layer in enumerate(plan.layers))
        self.norm = _norm(plan.final_norm, plan.hidden_size)
        # One table per distinct rotary (Gemma's local and global layers differ); none has weights.
        self.rotary_embs = {spec: RotaryEmbedding(spec.rotary_dim, spec.base, spec.scaling_dict)
                            for spec in dict.fromkeys(layer.attention.rotary for layer in plan.layers)}

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The first layer's rotary embedding (every layer's, unless the plan says otherwise)."""
        return self.rotary_embs[self.plan.layers[0].attention.rotary]

    def rotary_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryRows:
        """Every rotary's cos, sin rows for ``positions`` [num_tokens]."""
        return {spec: emb(positions, dtype) for spec, emb in self.rotary_embs.items()}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [num_tokens] -> [num_tokens, hidden_size], scaled as the plan says (in the
        activations' dtype, as HF's Gemma scales)."""
        # A quantized table dequantizes to fp32: rounded to the activations' dtype here.
        hidden_states = self.embed_tokens(input_ids).to(self.norm.weight.dtype)
        if self.plan.embedding_scale is not None:
            hidden_states = hidden_states * torch.tensor(self.plan.embedding_scale, dtype=hidden_states.dtype)
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: PagedAttentionMetadata, min_rows: int = 1) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        hidden_states = self.embed(input_ids)  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        rotary_rows = self.rotary_rows(positions, hidden_states.dtype)
        if num_tokens < min_rows:  # zero rows stay finite through RMSNorm and are dropped below
            hidden_states = F.pad(hidden_states, (0, 0, 0, min_rows - num_tokens))
        for layer in self.layers:
            hidden_states = layer(hidden_states, rotary_rows, kv_cache, meta)
        return self.norm(hidden_states[:num_tokens])


class CausalLM(nn.Module):
    """Decoder plus LM head, built from ``config``'s plan (or ``plan``). ``forward`` returns
    hidden states; ``compute_logits`` projects only the rows the caller needs (the last one of
    each sequence in plain decoding, k+1 rows in verification); ``logits`` does both, with the
    head inside the C++ step where it can.

    ``min_rows``: every matmul of the module path over fewer rows runs padded to exactly this
    many. A GEMM's result for one row depends on the shape it runs in, not on the other rows'
    values, so with ``min_rows = EXACT_MIN_ROWS`` a one-token decode step and a verification
    of up to that many tokens (k <= 4 drafts) give bit-identical results for the same token:
    speculative greedy decoding then reproduces plain greedy decoding exactly, in any dtype.
    Padding costs little because decoding is bound by reading the weights, which the padded
    rows share.
    """

    def __init__(self, config: ModelConfig, min_rows: int = EXACT_MIN_ROWS, plan: DecoderPlan | None = None) -> None:
        super().__init__()
        self.config = config
        self.plan = decoder_plan(config) if plan is None else plan
        self.min_rows = min_rows
        self.model = DecoderModel(self.plan)
        self.lm_head = Linear(self.plan.hidden_size, self.plan.vocab_size, bias=False)
        if self.plan.is_head_tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: PagedAttentionMetadata, decoder: DecoderStep | None = None) -> torch.Tensor:
        """One forward pass over a flat batch: input_ids, positions [num_tokens] -> final hidden
        states [num_tokens, hidden_size], every token's key and value written to ``kv_cache``.

        ``positions`` are ``meta.positions``, as vLLM's models take them. ``decoder``: the
        executor its caller built for this model (:meth:`fused_decoder`); without it, the module path."""
        if decoder is not None:
            return decoder.forward_paged(input_ids, positions, kv_cache, meta)
        return self.model(input_ids, positions, kv_cache, meta, self.min_rows)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
               meta: PagedAttentionMetadata, logit_rows: list[int],
               decoder: DecoderStep | None = None) -> torch.Tensor:
        """fp32 logits [len(logit_rows), vocab_size] of the flat batch's ``logit_rows``:
        ``compute_logits(forward(...)[logit_rows])`` bit for bit, with a weight-only head run
        inside ``decoder``'s C++ step where it can."""
        if decoder is not None and decoder.has_head:
            return self._softcap(decoder.logits_paged(input_ids, positions, kv_cache, meta, logit_rows))
        hidden = self(input_ids, positions, kv_cache, meta, decoder)  # [num_tokens, hidden_size]
        return self.compute_logits(hidden[logit_rows])

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.plan.final_logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., hidden_size] -> fp32 logits [..., vocab_size]."""
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        num_rows = rows.shape[0]
        if num_rows < self.min_rows:
            rows = F.pad(rows, (0, 0, 0, self.min_rows - num_rows))
        logits = self._softcap(self.lm_head(rows)[:num_rows].float())
        return logits.view(*hidden_states.shape[:-1], -1)

    def fused_decoder(self, block_size: int = 16) -> DecoderStep | None:
        """The executor of this model's plan on its device, over its modules as they are now,
        for a paged cache of ``block_size``-token blocks, for the caller to own and pass to
        ``forward`` or ``logits``: the C++ step on a CPU, the CUDA step on a GPU. None (the
        module path) where hooks observe a module, where the executor refuses a field of the
        plan (logged), or where it cannot take the weights or shapes."""
        if any(has_hooks(m) for m in self.modules()):
            return None  # observers see each module's call only on the module path
        executor = {"cuda": CudaDecoder, "cpu": FusedDecoder}.get(self.device.type)
        if executor is None:
            return None
        refusal = self.plan.refusal(executor.NAME, executor.IMPLEMENTS)
        if refusal is not None:
            logger.info("%s: the module path runs it", refusal)
            return None
        with torch.inference_mode():
            return executor.build(self, block_size)

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
