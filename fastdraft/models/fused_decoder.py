"""The C++ step: a decoder plan executed as one C++ call, the CPU backend of the forward pass.

A decode step is a few weight-bound matmuls per layer plus ~15 small ops; run from Python,
those small ops cost about as much as the elementwise work itself. :class:`FusedDecoder` runs
a flat batch of sequences over the paged cache, the serving engine's step, in
``csrc/decoder.cpp``: the embedding rows, the rotary rows, every decoder layer, the final
norm and a weight-only LM head, chaining the very kernels the module path calls, in the same
order and dtypes. The two give bit-identical results (tested), with one exception: on CPUs
with AMX, outside batch-invariant mode, the module path's weight-only matmuls over
``AMX_LARGE_M`` rows or more switch to a dequantized GEMM while the C++ step keeps its int8
tiles (long prefills differ in rounding there). The layers' structure comes from the plan
(``models/plan.py``); the modules give only the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.kernels.mode import is_batch_invariant
from fastdraft.kernels.ops.attention_ops import is_paged_block_size
from fastdraft.layers.kv_cache import PagedAttentionMetadata, PagedKVCache
from fastdraft.layers.linear import PROJECTION_GROUPS, cpu_linear_op, cpu_projections_op
from fastdraft.layers.quant_linear import QuantLinear
from fastdraft.models.plan import LayerPlan, NormSpec


def _norm_weight(ext, spec: NormSpec | None, owner: nn.Module, dtype: torch.dtype):
    """``spec``'s norm in ``owner`` as the C++ step takes it (None: no norm; False: it cannot
    take it): its weight in the activations' dtype, or the offset kind's fp32 ``1 + weight``."""
    if spec is None:
        return None
    norm = getattr(owner, spec.name)  # its eps, as the module path runs it
    weight = norm.weight.detach()
    if spec.is_offset:
        return ext.NormWeight((1.0 + weight.float()).contiguous(), True, norm.eps)
    if weight.dtype != dtype or not weight.is_contiguous():
        return False
    return ext.NormWeight(weight, False, norm.eps)


def _layer_op(ext, plan: LayerPlan, layer: nn.Module, rotary_index: int, dtype: torch.dtype, device: torch.device,
              min_rows: int):
    """The C++ layer of ``plan`` (its norms, q/k/v, o, gate/up, down, window and rotary) over
    ``layer``'s weights, or None where the C++ side cannot take them."""
    attn = plan.attention
    if attn.head_dim % 16 or attn.head_dim > 256 or not plan.mlp.is_gated:
        return None  # outside the paged attention kernel's shapes, or an MLP it does not run
    norms = [_norm_weight(ext, spec, layer, dtype) for spec in (plan.pre_attention_norm, plan.pre_mlp_norm,
                                                                 plan.post_attention_norm, plan.post_mlp_norm)]
    norms += [_norm_weight(ext, spec, layer.self_attn, dtype) for spec in (attn.q_norm, attn.k_norm)]
    if any(n is False for n in norms) or norms[0] is None or norms[1] is None:
        return None
    (attn_owner, qkv), (mlp_owner, gate_up) = PROJECTION_GROUPS
    ops = [cpu_projections_op(ext, layer.get_submodule(attn_owner), qkv, dtype, device, min_rows),
           cpu_linear_op(ext, layer.self_attn.o_proj, dtype, device, min_rows),
           cpu_projections_op(ext, layer.get_submodule(mlp_owner), gate_up, dtype, device, min_rows),
           cpu_linear_op(ext, layer.mlp.down_proj, dtype, device, min_rows)]
    if any(op is None for op in ops):
        return None
    return ext.DecoderLayer(*norms, *ops, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                            attn.sliding_window or 0, rotary_index, plan.mlp.activation)


class FusedDecoder:
    """A model's embedding, decoder layers, final norm and LM head as one C++ step, built for
    one activation dtype and ``min_rows``.

    Built from the modules as they are at that moment (``CausalLM.fused_decoder``) and owned by
    whoever built it: the engine's runner, a speculative proposer, and run by one thread at a
    time. A module replaced afterwards (quantized in place, say) is not seen; build a new
    decoder then. The pieces the C++ side cannot take run in Python around it: a scaled
    embedding or one of another format (INT8, say), a final norm of another dtype; the head
    runs inside only when it is weight-only."""

    NAME = "the C++ step"
    # The plan's features beyond the plain Llama layer that this executor runs (models/plan.py).
    IMPLEMENTS = frozenset({"embedding_scale", "final_logit_softcap", "offset_norm", "post_norm", "mixed_norm_eps",
                            "qk_norm", "sliding_window", "per_layer_rotary", "activation_gelu_tanh"})

    def __init__(self, ext, layer_ops: list, decoder: nn.Module, head, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.ext = ext
        self.layer_ops = layer_ops
        self.dtype, self.device = dtype, device
        self.is_weight_only = ext.decoder_is_weight_only(layer_ops)
        self.decoder, self.norm, self._head = decoder, decoder.norm, head
        self._step = None
        self._step_key: tuple | None = None
        self._is_norm_inside = False  # of the current step

    def _current_step(self):
        """The C++ step, built again when the embedding table or the final norm it holds has
        changed in place (a ``.data`` swap, a new eps) since it was built."""
        embed, norm = self.decoder.embed_tokens, self.norm
        is_table = (type(embed) is nn.Embedding and embed.weight.dtype == self.dtype
                    and embed.weight.is_contiguous() and self.decoder.plan.embedding_scale is None)
        is_norm_inside = _is_fusable_norm(norm, self.dtype)
        key = (is_table and embed.weight.data_ptr(), is_norm_inside and norm.weight.data_ptr(), norm.eps)
        if key != self._step_key:
            final_norm = _norm_weight(self.ext, self.decoder.plan.final_norm, self.decoder, self.dtype)
            self._step = self.ext.PagedDecoder(self.layer_ops, embed.weight.detach() if is_table else None,
                                               final_norm if is_norm_inside else None,
                                               self._head if self.has_head else None)
            self._step_key = key
            self._is_norm_inside = is_norm_inside
        return self._step

    @property
    def has_head(self) -> bool:
        """Whether the LM head runs inside the C++ step (weight-only throughout, the final norm inside)."""
        return self._head is not None and self.is_weight_only and _is_fusable_norm(self.norm, self.dtype)

    @classmethod
    def build(cls, model: nn.Module, block_size: int) -> "FusedDecoder | None":
        """The C++ step of ``model`` (a ``CausalLM`` on the CPU whose plan it implements), or
        None where the C++ side cannot take its weights or shapes (no CPU kernels, a dtype other
        than fp32 and bf16, a weight format or head size it does not take, a block size that is
        not a power of two)."""
        ext = load_cpu_kernels()
        dtype, device, min_rows = model.dtype, model.device, model.min_rows
        if ext is None or dtype not in (torch.float32, torch.bfloat16) or not is_paged_block_size(block_size):
            return None
        decoder = model.model
        rotaries = list(decoder.rotary_embs)  # a layer's rotary: its index into the step's tables
        ops = [_layer_op(ext, plan, layer, rotaries.index(plan.attention.rotary), dtype, device, min_rows)
               for plan, layer in zip(decoder.plan.layers, decoder.layers)]
        if any(op is None for op in ops):
            return None
        lm_head = model.lm_head
        head = cpu_linear_op(ext, lm_head, dtype, device, min_rows) if isinstance(lm_head, QuantLinear) else None
        return cls(ext, ops, decoder, head, dtype, device)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
             meta: PagedAttentionMetadata, logit_rows: torch.Tensor | None) -> torch.Tensor:
        step = self._current_step()
        # Rotary tables cover every position of the step: its longest context.
        num_positions = max(meta.context_lens)
        tables = [emb.tables(num_positions, self.dtype, self.device) for emb in self.decoder.rotary_embs.values()]
        hidden = None if step.has_embedding else self.decoder.embed(input_ids)  # [num_tokens, hidden_size]
        return step.forward(input_ids, hidden, positions, [cos for cos, _ in tables], [sin for _, sin in tables],
                            kv_cache.k, kv_cache.v, meta.slot_mapping,
                            meta.block_tables, meta.query_start_loc_tensor, meta.context_lens_tensor, logit_rows,
                            is_batch_invariant())

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                      meta: PagedAttentionMetadata) -> torch.Tensor:
        """A flat batch: input_ids, positions [num_tokens] -> final hidden states [num_tokens,
        hidden_size], bit-identical to the module path. Weight-only layers run in one parallel
        region; dense ones layer by layer, their kernels as
        :func:`~fastdraft.kernels.mode.is_batch_invariant` says."""
        out = self._run(input_ids, positions, kv_cache, meta, None)
        return out if self._is_norm_inside else self.norm(out)

    def logits_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                     meta: PagedAttentionMetadata, logit_rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(logit_rows), vocab_size] of a flat batch before any soft-cap, the
        weight-only head run inside the step's parallel region (``has_head``)."""
        if not self.has_head:
            raise ValueError("this decoder's LM head runs in Python: use forward_paged and the model's head")
        return self._run(input_ids, positions, kv_cache, meta, torch.tensor(logit_rows, dtype=torch.long))


def _is_fusable_norm(norm: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the final norm can run inside the C++ call (else it runs in Python): the offset
    kind always (its weight goes in as fp32), the other in the activations' dtype."""
    return norm.is_offset or (norm.weight.dtype == dtype and norm.weight.is_contiguous())
