"""The decoder layers of a Llama-family model as one C++ call: the CPU backend of its forward pass.

A decode step is a few weight-bound matmuls per layer plus ~15 small ops; run from Python,
those small ops cost about as much as the elementwise work itself. :class:`FusedDecoder` runs
all decoder layers in ``csrc/decoder_x86.cpp``, which chains the very kernels the module path
calls, in the same order and dtypes: for a flat batch of sequences over a paged cache (the
serving engine's step), and for a few tokens appended to one contiguous cache (the decode
timing of the quantization search). The paths give bit-identical results (tested); the module
path in ``llama.py`` is the reference twin and serves hooks and CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.kernels.build import load_x86_extension
from fastdraft.kernels.mode import is_batch_invariant
from fastdraft.kernels.x86 import X86WoqKernel
from fastdraft.layers.attention import MAX_CAUSAL_DECODE_TOKENS
from fastdraft.layers.kv_cache import AttentionMetadata, KVCache, PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.linear import FusedLinear, fused_linear, has_hooks, is_dense_linear
from fastdraft.layers.quant_linear import QuantLinear

# Tokens per pass for which the module path's attention makes the same decode_attention call
# as the fused path (layers.attention.cached_attention), so the two stay bit-identical.
MAX_FUSED_TOKENS = MAX_CAUSAL_DECODE_TOKENS


def _linear_op(ext, linear: FusedLinear | nn.Module | None, dtype: torch.dtype, device: torch.device,
               min_rows: int):
    """The C++ ``Linear`` for a fused or single projection, or ``None`` if it cannot run there."""
    if linear is None or (isinstance(linear, nn.Module) and has_hooks(linear)):
        return None
    if is_dense_linear(linear):
        linear = FusedLinear(weight=linear.weight.detach(),
                             bias=None if linear.bias is None else linear.bias.detach())
    elif isinstance(linear, QuantLinear):
        bias = None if linear.bias is None else linear.bias.detach()
        linear = FusedLinear(kernel=linear.kernel_for(dtype, device), bias=bias)
    elif not isinstance(linear, FusedLinear):
        return None
    if linear.bias is not None and linear.bias.dtype != dtype:
        return None
    if linear.kernel is None:
        if linear.weight.dtype != dtype:
            return None
        return ext.dense_linear(linear.weight, linear.bias, min_rows)
    kernel = linear.kernel
    if not isinstance(kernel, X86WoqKernel) or kernel.large_m <= MAX_FUSED_TOKENS:
        return None
    return ext.woq_linear_op(*kernel.op_args, linear.bias)


def _projections_op(ext, owner: nn.Module, names: tuple[str, ...], dtype: torch.dtype, device: torch.device,
                    min_rows: int):
    """One C++ op for projections sharing an input (q/k/v, gate/up): their fused matmul, or,
    when their formats differ (e.g. an INT8 v_proj beside INT4 q/k), each run in turn and
    concatenated, as the module path does."""
    fused = fused_linear([getattr(owner, name) for name in names], dtype, device)
    if fused is not None:
        return _linear_op(ext, fused, dtype, device, min_rows)
    parts = [_linear_op(ext, getattr(owner, name), dtype, device, min_rows) for name in names]
    return None if any(part is None for part in parts) else ext.concat_linear(parts)


def _layer_op(ext, layer: nn.Module, dtype: torch.dtype, device: torch.device, min_rows: int):
    attn, mlp = layer.self_attn, layer.mlp
    if attn.head_dim % 16 or attn.head_dim > 256:
        return None  # outside decode_attention's shapes
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(has_hooks(m) for m in (layer, attn, mlp, *norms)):
        return None
    if any(n.weight.dtype != dtype or n.eps != norms[0].eps for n in norms):
        return None
    qkv_names, gate_up_names = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    if any(has_hooks(getattr(attn, n)) for n in qkv_names) or any(has_hooks(getattr(mlp, n)) for n in gate_up_names):
        return None
    ops = [_projections_op(ext, attn, qkv_names, dtype, device, min_rows),
           _linear_op(ext, attn.o_proj, dtype, device, min_rows),
           _projections_op(ext, mlp, gate_up_names, dtype, device, min_rows),
           _linear_op(ext, mlp.down_proj, dtype, device, min_rows)]
    if any(op is None for op in ops):
        return None
    return ext.DecoderLayer(norms[0].weight.detach(), norms[1].weight.detach(), norms[0].eps, *ops,
                            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)


class FusedDecoder:
    """All decoder layers of one model, built for one activation dtype and ``min_rows``.

    Built from the layers' modules as they are at that moment (``LlamaForCausalLM.fused_decoder``)
    and owned by whoever built it: the engine's runner, a speculative proposer. A module
    replaced afterwards (quantized in place, say) is not seen; build a new decoder then."""

    def __init__(self, ext, layer_ops: list, dtype: torch.dtype, device: torch.device, min_rows: int) -> None:
        self.ext = ext
        self.layer_ops = layer_ops
        self.dtype, self.device, self.min_rows = dtype, device, min_rows
        self.is_weight_only = ext.decoder_is_weight_only(layer_ops)
        self._head: tuple[nn.Module, object] | None = None  # (LM head module, its C++ op)
        # (the tensors and ops a C++ DecoderStep was built from, the slot, storages and eps,
        # the step): one KV cache slot
        self._step: tuple[tuple, tuple, object] | None = None

    @classmethod
    def build(cls, layers: nn.ModuleList, dtype: torch.dtype, device: torch.device,
              min_rows: int) -> "FusedDecoder | None":
        """The decoder of ``layers`` for activations of ``dtype``, or None where the C++ side
        cannot run them (no CPU kernels, a dtype other than fp32 and bf16, a layer it does not take)."""
        ext = load_x86_extension()
        if ext is None or dtype not in (torch.float32, torch.bfloat16):
            return None
        ops = [_layer_op(ext, layer, dtype, device, min_rows) for layer in layers]
        return None if any(op is None for op in ops) else cls(ext, ops, dtype, device, min_rows)

    def is_fusable_norm(self, norm: nn.Module) -> bool:
        """Whether the final norm can run inside the C++ call (else it runs in Python)."""
        weight = getattr(norm, "weight", None)
        return weight is not None and not has_hooks(norm) and weight.dtype == self.dtype and weight.is_contiguous()

    def norm_args(self, norm: nn.Module) -> tuple[torch.Tensor, float] | None:
        """The final norm as the C++ call takes it, or None if it must run in Python."""
        return (norm.weight.detach(), norm.eps) if self.is_fusable_norm(norm) else None

    def head_op(self, lm_head: nn.Module):
        """The C++ op of ``lm_head`` (cached while the module stays the same), or None."""
        if self._head is None or self._head[0] is not lm_head:
            self._head = (lm_head, _linear_op(self.ext, lm_head, self.dtype, self.device, self.min_rows))
        return self._head[1]

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, norm: tuple[torch.Tensor, float] | None = None, head=None,
                num_logit_rows: int = 0) -> torch.Tensor:
        """hidden_states [num_tokens, hidden_size], cos/sin [num_tokens, head_dim] of one
        sequence appended at ``meta.contiguous_start`` -> hidden states after the last layer;
        with ``norm`` (``norm_args``) after the final norm too; with a ``head`` op as well, the
        head's output [num_logit_rows, out_features] for the last rows (a weight-only head runs
        inside the decoder's parallel region, with no Python between)."""
        slot = meta.slot
        weight, eps = norm if norm is not None else (None, 0.0)
        return self.ext.decoder_forward(self.layer_ops, hidden_states, cos, sin, kv_cache.k[:, slot],
                                        kv_cache.v[:, slot], meta.contiguous_start, weight, eps, head,
                                        num_logit_rows)

    def accepts(self, kv_cache: KVCache, meta: AttentionMetadata) -> bool:
        """Whether a pass over a contiguous cache can run here: a decode or verification step
        of one sequence, at most ``MAX_FUSED_TOKENS`` tokens, in this decoder's dtype."""
        return (meta.batch_size == 1 and meta.contiguous_start is not None and not meta.is_prefill
                and meta.num_tokens <= MAX_FUSED_TOKENS and kv_cache.k.dtype == self.dtype
                and not torch.is_grad_enabled())

    def forward_paged(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: PagedKVCache, meta: PagedAttentionMetadata,
                      norm: tuple[torch.Tensor, float] | None = None, head=None,
                      logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """A flat batch of sequences over a paged cache: hidden_states [num_tokens, hidden_size],
        cos/sin [num_tokens, head_dim] -> hidden states after the last layer (after the final
        norm too with ``norm``), all layers in one C++ parallel region, bit-identical to the
        module path. Weight-only layers run in one parallel region; with a weight-only ``head``
        op and ``logit_rows`` [n] too, it returns the fp32 logits [n, vocab_size] of those
        rows, the head run inside the region. Dense layers run one by one, their kernels as
        :func:`~fastdraft.kernels.mode.is_batch_invariant` says."""
        weight, eps = norm if norm is not None else (None, 0.0)
        return self.ext.decoder_forward_paged(self.layer_ops, hidden_states, cos, sin, kv_cache.k, kv_cache.v,
                                              meta.slot_mapping, meta.block_tables, meta.query_start_loc_tensor,
                                              meta.context_lens_tensor, weight, eps, head, logit_rows,
                                              is_batch_invariant())

    def logits(self, input_ids: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, embed: nn.Embedding,
               rotary: nn.Module, norm: nn.Module, lm_head: nn.Module, num_logit_rows: int) -> torch.Tensor | None:
        """fp32 logits [num_logit_rows, out_features] of a whole step from ``input_ids``
        [1, num_tokens] in one C++ call (embedding, rotary rows, layers, final norm, head), or
        None when the embedding, final norm or head cannot run there. The C++ step is kept
        while the cache slot, the embedding, the rotary table and the head stay the same."""
        if has_hooks(embed) or embed.weight.dtype != self.dtype or not embed.weight.is_contiguous():
            return None
        head = self.head_op(lm_head) if self.is_fusable_norm(norm) else None
        if head is None:
            return None
        num_tokens = input_ids.shape[1]
        cos, sin = rotary.tables(meta.contiguous_start + num_tokens, self.dtype, self.device)
        slot = meta.slot
        # Tensors and ops compared by identity; the weights also by storage and the eps by value,
        # so that an in-place `.data` swap or a changed eps builds a new step.
        key = (kv_cache.k, kv_cache.v, cos, head, embed.weight, norm.weight)
        values = (slot, embed.weight.data_ptr(), norm.weight.data_ptr(), norm.eps)
        if (self._step is None or any(a is not b for a, b in zip(self._step[0], key))
                or self._step[1] != values):
            step = self.ext.DecoderStep(self.layer_ops, embed.weight.detach(), cos, sin, kv_cache.k[:, slot],
                                        kv_cache.v[:, slot], norm.weight.detach(), norm.eps, head)
            self._step = (key, values, step)
        return self._step[2].logits(input_ids.view(-1), meta.contiguous_start, num_logit_rows)
