"""Paged attention of a flat batch in Triton: one launch per layer for every scheduled token of
a step (decode rows, chunked-prefill pieces, prefill over cached prefix blocks), and one launch
to write the step's keys and values into their cache slots.

The attention kernel's program covers one tile of a sequence's query tokens for one KV head:
the query heads that share that KV head are packed into the tile's rows (grouped-query
attention reads each key block once for the whole group). Tiles are numbered sequence after
sequence, ``query_start_loc[s] // BLOCK_Q + s`` being sequence ``s``'s first, so a program finds
its sequence by a binary search over ``query_start_loc`` and the launch needs no per-sequence
table from the host. Keys are read straight from the sequence's blocks through its block table,
block by block, with an online softmax; a query row sees the keys up to its own position.

Short batches leave most of a GPU idle, so a sequence's keys may be split into chunks computed
by separate programs and merged by a second kernel. The chunk length depends only on the
batch-size bucket, and a sequence's number of chunks only on its own length: a request's result
never depends on what else shares its step.

The PyTorch twin is :func:`fastdraft.kernels.ops.attention_ops.reference_paged_attention`,
which the tests compare with these kernels, on a GPU and through Triton's interpreter
(``TRITON_INTERPRET=1``) on the CPU.
"""

from __future__ import annotations

import os

import torch

triton = tl = None
# Triton runs on a GPU, or on the CPU through its interpreter (tests): a process with neither
# does not pay for its import.
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:  # the CPU path needs no Triton
        pass

# Query rows of a tile: at least 16, the smallest tile tl.dot takes.
MIN_TILE_ROWS = 16
# Batches of more sequences than this fill a GPU without splitting their keys.
MAX_SPLIT_BATCH = 16
# Keys a chunk covers for a batch of one sequence; each doubling of the batch bucket doubles it.
SPLIT_CHUNK_KEYS = 256


def is_available() -> bool:
    """Whether Triton is installed (a GPU, or ``TRITON_INTERPRET=1``, must then run it)."""
    return triton is not None


def applies(q: torch.Tensor, k_blocks: torch.Tensor) -> bool:
    """Whether :func:`triton_paged_attention` runs for these tensors: on a GPU, with key blocks of a
    multiple of 16 positions and heads of at least 16 dimensions (a ``tl.dot`` tile's least)."""
    return (triton is not None and q.is_cuda and k_blocks.shape[2] % MIN_TILE_ROWS == 0
            and q.shape[-1] >= MIN_TILE_ROWS and k_blocks.stride(3) == 1)


def next_power_of_two(n: int) -> int:
    """The least power of two at or above ``n`` (1 for 0): Triton's block shapes are powers of two."""
    return 1 << max(n - 1, 0).bit_length()


def split_chunk_keys(num_seqs: int) -> int:
    """Keys per split chunk for a step of ``num_seqs`` sequences (0: no split). By the
    batch-size bucket only, so that a sequence's chunks never depend on its batch mates."""
    bucket = next_power_of_two(num_seqs)
    return 0 if bucket > MAX_SPLIT_BATCH else SPLIT_CHUNK_KEYS * bucket


if triton is not None:

    @triton.jit
    def _find_seq(query_start_loc_ptr, num_seqs, index, BLOCK_Q: tl.constexpr, IS_TILE: tl.constexpr):
        """The largest sequence ``s`` whose first query tile (``IS_TILE``; tiles of ``BLOCK_Q``
        tokens) or first token is at or before ``index``."""
        lo = 0
        hi = num_seqs
        while lo < hi - 1:
            mid = (lo + hi) // 2
            first = tl.load(query_start_loc_ptr + mid)
            if IS_TILE:
                first = first // BLOCK_Q + mid
            if first <= index:
                lo = mid
            else:
                hi = mid
        return lo

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr,
                          seq_lens_ptr, query_start_loc_ptr, scale, num_seqs, num_tokens, split_keys,
                          stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_ot, stride_oh, stride_bt,
                          GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_Q: tl.constexpr, IS_SPLIT: tl.constexpr, PRECISION: tl.constexpr):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q, True)
        q_begin = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
        q_first = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
        if q_first < q_len:
            ctx_len = tl.load(seq_lens_ptr + seq)
            offs_m = tl.arange(0, BLOCK_M)
            q_idx = q_first + offs_m // GROUP  # [BLOCK_M] the row's token within the sequence
            head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] the row's query head
            row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
            offs_d = tl.arange(0, HEAD_DIM_PAD)
            d_ok = offs_d < HEAD_DIM
            token = q_begin + q_idx
            q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
            query_pos = ctx_len - q_len + q_idx  # [BLOCK_M]
            # The tile's last row sees keys up to its own position; the chunk bounds the rest.
            key_end = ctx_len - q_len + tl.minimum(q_first + BLOCK_Q, q_len)
            key_begin = 0
            if IS_SPLIT:
                key_begin = split * split_keys
                key_end = tl.minimum(key_end, key_begin + split_keys)
            offs_s = tl.arange(0, BLOCK_SIZE)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
            kv_offsets = kv_head * stride_kh + offs_s[:, None] * stride_ks + offs_d[None, :]
            # while, not range: the bounds are loaded values, which Triton's interpreter cannot
            # take as range bounds.
            start = key_begin
            while start < key_end:
                block = tl.load(block_tables_ptr + seq * stride_bt + start // BLOCK_SIZE)
                k = tl.load(k_ptr + block * stride_kb + kv_offsets, mask=d_ok[None, :], other=0.0)  # [BS, D]
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_SIZE]
                key_pos = start + offs_s
                visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < key_end)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + block * stride_kb + kv_offsets, mask=d_ok[None, :], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
                start += BLOCK_SIZE
            if IS_SPLIT:
                # Partials [num_splits, num_tokens, NUM_HEADS, HEAD_DIM_PAD] and [..., 2] (max, sum).
                row = (split * num_tokens + token) * NUM_HEADS + head
                tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
                tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
                tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
            else:
                out = acc / l_i[:, None]
                tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_kernel(out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs, num_tokens,
                      split_keys, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PAD: tl.constexpr):
        """One row (token, head) of split attention: its chunks' partials merged, in chunk order."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        seq = _find_seq(query_start_loc_ptr, num_seqs, token, 1, False)
        num_splits = tl.cdiv(tl.load(seq_lens_ptr + seq), split_keys)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        m_all = tl.full([1], float("-inf"), tl.float32)
        split = 0
        while split < num_splits:
            row = (split * num_tokens + token) * NUM_HEADS + head
            m_all = tl.maximum(m_all, tl.load(part_ml_ptr + row * 2 + tl.zeros([1], tl.int32)))
            split += 1
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
        split = 0
        while split < num_splits:
            row = (split * num_tokens + token) * NUM_HEADS + head
            m = tl.load(part_ml_ptr + row * 2 + tl.zeros([1], tl.int32))
            weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # a chunk past the row's keys
            total += weight * tl.load(part_ml_ptr + row * 2 + 1 + tl.zeros([1], tl.int32))
            acc += weight * tl.load(part_acc_ptr + row * HEAD_DIM_PAD + offs_d)
            split += 1
        out = acc / total
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_cb, stride_ch, stride_cs, NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """One token's keys and values [NUM_KV_HEADS, HEAD_DIM] into its slot (-1: skip)."""
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            offs_h = tl.arange(0, NUM_KV_HEADS_PAD)
            offs_d = tl.arange(0, HEAD_DIM_PAD)
            ok = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
            k_source = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
            v_source = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            target = (slot // BLOCK_SIZE) * stride_cb + offs_h[:, None] * stride_ch + (slot % BLOCK_SIZE) * stride_cs \
                + offs_d[None, :]
            tl.store(k_cache_ptr + target, tl.load(k_ptr + k_source, mask=ok), mask=ok)
            tl.store(v_cache_ptr + target, tl.load(v_ptr + v_source, mask=ok), mask=ok)


def _check(q: torch.Tensor, k_blocks: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if q.shape[1] % k_blocks.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_blocks.shape[1]} KV heads")
    if k_blocks.stride(3) != 1:
        raise ValueError("the KV blocks' last dimension must be contiguous")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the blocks [num_blocks,
    num_kv_heads, block_size, head_dim] at ``slot_mapping`` [num_tokens] (-1: skip the token).
    k and v may be column slices of wider rows (a fused qkv projection's)."""
    _check(k, k_blocks)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_blocks, v_blocks, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_blocks.stride(0), k_blocks.stride(1),
        k_blocks.stride(2), NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PAD=next_power_of_two(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_two(head_dim), BLOCK_SIZE=k_blocks.shape[2])


def triton_paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_seq_len: int, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a flat batch q [num_tokens, num_heads, head_dim] over paged k/v_blocks
    [num_blocks, num_kv_heads, block_size, head_dim]: sequence ``s`` owns the query rows
    ``query_start_loc[s]:query_start_loc[s + 1]`` (int32, [num_seqs + 1]), which are the last of
    its ``seq_lens[s]`` keys (int32, [num_seqs]), found through ``block_tables[s]`` (int32,
    [num_seqs, max_blocks]). ``max_seq_len`` bounds ``seq_lens`` (it sizes the split grid).
    Returns ``out`` [num_tokens, num_heads, head_dim]."""
    _check(q, k_blocks)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_blocks.shape[1], k_blocks.shape[2]
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    block_m = max(MIN_TILE_ROWS, next_power_of_two(group))
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    head_dim_pad = next_power_of_two(head_dim)
    split_keys = split_chunk_keys(num_seqs)
    num_splits = -(-max_seq_len // split_keys) if split_keys else 1
    is_split = num_splits > 1
    if is_split:
        part_acc = torch.empty(num_splits, num_tokens, num_heads, head_dim_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not read
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_blocks, v_blocks, out, part_acc, part_ml, block_tables, seq_lens, query_start_loc, scale, num_seqs,
        num_tokens, max(split_keys, block_size), q.stride(0), q.stride(1), k_blocks.stride(0), k_blocks.stride(1),
        k_blocks.stride(2), out.stride(0), out.stride(1), block_tables.stride(0), GROUP=group, NUM_HEADS=num_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        IS_SPLIT=is_split, PRECISION=precision)
    if is_split:
        _merge_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, seq_lens, query_start_loc, num_seqs, num_tokens, split_keys, out.stride(0),
            out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad)
    return out
