"""fastdraft's C++ x86 kernels against their plain PyTorch twins."""

import pytest
import torch
import torch.nn.functional as F

from fastdraft.formats import PER_CHANNEL, dequantize, quantize, unpack_int6
from fastdraft.kernels import fused, select_kernel
from fastdraft.kernels.ops import activation_ops, attention_ops, norm_ops
from fastdraft.kernels.ops.attention_ops import PagedAttentionMetadata
from fastdraft.kernels.build import clear_caches, load_cpu_kernels
from fastdraft.kernels.mode import batch_invariant
from fastdraft.kernels.x86 import X86WoqKernel, reference_woq_matmul, repack
from fastdraft.layers.sampler import greedy_ids
from tests.helpers import assert_tokens_equal_one_token_calls

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None,
                                reason="x86 kernels unavailable (no AVX-512 VNNI or no compiler)")
CPU = torch.device("cpu")
# (out_features, in_features): tile tails (N % 16), K padded to 128, long K, tiny K
SHAPES = [(96, 256), (37, 96), (200, 512), (48, 3072), (16, 64)]


def _weights():
    for n, k in SHAPES:
        for g in (16, 32, 64, 128, 256, 512, 1024, PER_CHANNEL):
            if g != PER_CHANNEL and k % g:
                continue
            for bits, scheme in ((4, "sym"), (4, "asym"), (4, "asymf"), (6, "sym"), (8, "sym")):
                if bits == 8 and g != PER_CHANNEL and g not in (16, 32, 128):
                    continue
                if bits == 6 and k % 4:
                    continue
                yield pytest.param(n, k, g, bits, scheme, id=f"{n}x{k}-g{g}-int{bits}-{scheme}")


@pytest.mark.parametrize("n,k,group_size,bits,scheme", list(_weights()))
def test_vnni_matches_twin_and_dense(n, k, group_size, bits, scheme):
    torch.manual_seed(n + k)
    qw = quantize(torch.randn(n, k), bits, group_size, sym=scheme == "sym", float_zeros=scheme == "asymf")
    kernel = X86WoqKernel(qw, torch.float32, CPU, large_m=None)
    dense = dequantize(qw)
    for m in (1, 2, 3, 5, 8, 9, 33):
        x = torch.randn(m, k)
        out = kernel(x)
        twin = reference_woq_matmul(x, qw)
        scale = twin.abs().max().item()
        assert (out.double() - twin).abs().max().item() <= 1e-5 * scale, f"M={m}"
        assert (out - x @ dense.t()).abs().max().item() <= 2e-2 * scale, f"M={m}"


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (6, True), (8, True)])
def test_rows_are_bit_identical_whatever_the_row_count(bits, sym):
    """Verification of k drafts must reproduce one-token decoding exactly."""
    qw = quantize(torch.randn(80, 384), bits, 128 if bits == 4 else PER_CHANNEL, sym)
    kernel = X86WoqKernel(qw, torch.bfloat16, CPU, large_m=None)
    x = torch.randn(11, 384).to(torch.bfloat16)
    together = kernel(x)
    for i in range(x.shape[0]):
        assert torch.equal(kernel(x[i:i + 1])[0], together[i])
    assert torch.equal(kernel(x[2:7]), together[2:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["sym", "asym", "asymf"])
def test_large_m_path_dequantizes_exactly(dtype, scheme):
    qw = quantize(torch.randn(50, 320), 4, 64, sym=scheme == "sym", float_zeros=scheme == "asymf")
    kernel = X86WoqKernel(qw, dtype, CPU, large_m=4)
    assert torch.equal(kernel.dense_weight(torch.float32), dequantize(qw))
    x = torch.randn(6, 320).to(dtype)
    expected = F.linear(x, dequantize(qw, dtype))
    assert torch.allclose(kernel(x).float(), expected.float(), rtol=1e-5, atol=1e-5)


def test_batch_invariant_mode_keeps_large_m_on_the_row_invariant_kernel():
    qw = quantize(torch.randn(50, 320), 4, 64, sym=True)
    kernel = X86WoqKernel(qw, torch.bfloat16, CPU, large_m=4)
    x = torch.randn(6, 320).to(torch.bfloat16)
    with batch_invariant():
        together = kernel(x)
        assert torch.equal(kernel(x[3:4])[0], together[3])
    assert torch.equal(together, X86WoqKernel(qw, torch.bfloat16, CPU, large_m=None)(x))


def test_int8_dense_weight_and_bf16_output():
    qw = quantize(torch.randn(40, 256), 8, PER_CHANNEL, sym=True)
    kernel = X86WoqKernel(qw, torch.bfloat16, CPU, large_m=None)
    assert torch.equal(kernel.dense_weight(torch.float32), dequantize(qw))
    x = torch.randn(3, 256).to(torch.bfloat16)
    out = kernel(x)
    assert out.dtype == torch.bfloat16
    expected = reference_woq_matmul(x, qw).to(torch.bfloat16)  # one rounding apart at most
    assert torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)


def test_repack_layout_of_one_tile():
    """Spot-check the documented layout: chunk c, row n, byte j holds k = 8c + j and 8c + 4 + j."""
    qw = quantize(torch.randn(16, 128), 4, 128, sym=True)
    q = torch.stack((qw.qweight & 15, qw.qweight >> 4), -1).flatten(-2)  # [16, 128]
    packed = repack(qw).packed  # [1, 16 chunks, 16 rows, 4 bytes]
    for c, n, j in ((0, 0, 0), (3, 5, 2), (15, 15, 3)):
        byte = int(packed[0, c, n, j])
        assert byte & 15 == q[n, 8 * c + j] and byte >> 4 == q[n, 8 * c + 4 + j]


@pytest.mark.parametrize("bits,group,sym,float_zeros", [(4, 32, True, False), (4, 16, False, False),
                                                     (4, 32, False, True), (4, -1, False, False), (6, 32, True, False),
                                                     (6, 16, True, False), (8, 32, True, False), (8, -1, True, False)])
@pytest.mark.parametrize("n,k", [(16, 128), (37, 160), (5, 96)])
def test_cpp_repack_matches_its_twin(bits, group, sym, float_zeros, n, k):
    """The C++ layout of the codes is the PyTorch one byte for byte, scales and zeros alike, for
    every tile size a variant uses (INT6: 16 rows only), rows and columns padded."""
    ext = load_cpu_kernels()
    if ext is None:
        pytest.skip("x86 kernels unavailable on this CPU")
    torch.manual_seed(n + k)
    qw = quantize(torch.randn(n, k), bits, group, sym=sym, float_zeros=float_zeros)
    for tile in {16, ext.tile_rows} if bits != 6 else {16}:
        fast, twin = repack(qw, tile, ext), repack(qw, tile)
        assert torch.equal(fast.packed, twin.packed), tile
        assert torch.equal(fast.scales, twin.scales) and torch.equal(fast.zeros, twin.zeros)


def test_repack_layout_of_one_int6_tile():
    """INT6: INT4's nibble bytes, then bits 4-5 of nibble bytes p and p + 32 in high byte p."""
    qw = quantize(torch.randn(16, 128), 6, 128, sym=True)
    q = unpack_int6(qw.qweight)  # [16, 128] 0..63
    packed = repack(qw).packed  # [1, 16 chunks, 96 bytes]
    assert packed.shape == (1, 16, 96)
    for c, n, j in ((0, 0, 0), (3, 5, 2), (9, 8, 1), (15, 15, 3)):
        p = 4 * n + j
        nibble, high = int(packed[0, c, p]), int(packed[0, c, 64 + p % 32]) >> (0 if p < 32 else 4)
        assert nibble & 15 | (high & 3) << 4 == q[n, 8 * c + j]
        assert nibble >> 4 | (high >> 2 & 3) << 4 == q[n, 8 * c + 4 + j]


def test_selected_for_supported_weights():
    qw = quantize(torch.randn(64, 256), 4, 128, sym=False)
    assert select_kernel(qw, torch.bfloat16, "cpu").name == "x86"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_their_twins(dtype):
    torch.manual_seed(0)
    tol = 0 if dtype == torch.bfloat16 else 1e-6  # bf16: same roundings, so mostly exact
    x, w = torch.randn(5, 200).to(dtype), torch.randn(200).to(dtype)
    assert torch.allclose(norm_ops.rms_norm(x, w, 1e-6).float(), norm_ops.reference_rms_norm(x, w, 1e-6).float(),
                          rtol=1e-5, atol=1e-5)
    # Gemma's offset norm: fp32 throughout, one rounding, as the reference (the sums' order aside).
    offset, reference = norm_ops.rms_norm(x, w, 1e-6, True), norm_ops.reference_rms_norm(x, w, 1e-6, True)
    assert offset.dtype == dtype
    assert torch.allclose(offset.float(), reference.float(), rtol=2**-8 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    gate_up = (torch.randn(3, 2 * 70) * 5).to(dtype)
    assert torch.allclose(activation_ops.silu_and_mul(gate_up).float(), activation_ops.reference_silu_and_mul(gate_up).float(),
                          rtol=1e-5 + tol, atol=1e-5)
    # GELU-tanh through exp (as g sigmoid(2u)), torch through tanh: equal up to the last bits.
    for scale in (1.0, 6.0):
        gate_up = (torch.randn(3, 2 * 70) * scale).to(dtype)
        got = activation_ops.gated_activation(gate_up, "gelu_tanh")
        want = activation_ops.reference_gated_activation(gate_up, "gelu_tanh")
        assert torch.allclose(got.float(), want.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    qkv = torch.randn(2, 3, 4 * 32 + 2 * 32).to(dtype)  # a q slice of a fused projection row
    q = qkv[..., :4 * 32].view(2, 3, 4, 32)
    cos, sin = torch.randn(2, 3, 32).to(dtype), torch.randn(2, 3, 32).to(dtype)
    assert torch.allclose(fused.rotary(q, cos, sin).float(), fused.reference_rotary(q, cos, sin).float(),
                          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_causal_tokens_equal_one_token_calls(dtype):
    # The twin is what runs on CUDA: each token must get exactly its one-token result, or
    # greedy speculative decoding would stop reproducing plain greedy decoding there.
    torch.manual_seed(0)
    group, d, length, num_tokens = 3, 32, 40, 4
    q = torch.randn(1, 2, num_tokens * group, d).to(dtype)
    cache_k, cache_v = torch.randn(1, 2, 64, d).to(dtype), torch.randn(1, 2, 64, d).to(dtype)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # views of longer keys, as the paged twin passes them
    out = attention_ops.per_token_attention(q, k, v, d ** -0.5, num_tokens)
    assert_tokens_equal_one_token_calls(out, lambda *qkv: attention_ops.per_token_attention(*qkv, d ** -0.5),
                                        q, k, v, num_tokens)


def test_causal_tokens_bad_shape_is_a_value_error():
    q, k = torch.randn(1, 1, 5, 32), torch.randn(1, 1, 8, 32)
    with pytest.raises(ValueError, match="tokens"):
        attention_ops.per_token_attention(q, k, k, 1.0, num_tokens=2)


def _meta(tables, query_start_loc, context_lens) -> PagedAttentionMetadata:
    """The metadata attention reads (the tokens' positions and slots are not read)."""
    num_tokens = query_start_loc[-1]
    return PagedAttentionMetadata(torch.zeros(num_tokens, dtype=torch.long), torch.zeros(num_tokens, dtype=torch.long),
                                  list(query_start_loc), list(context_lens), tables)


def _attend(q, k_blocks, v_blocks, tables, query_start_loc, context_lens, scale):
    return attention_ops.paged_attention(q, k_blocks, v_blocks, _meta(tables, query_start_loc, context_lens), scale)


def _twin(q, k_blocks, v_blocks, tables, query_start_loc, context_lens, scale):
    meta = _meta(tables, query_start_loc, context_lens)
    return attention_ops.reference_paged_attention(q, k_blocks, v_blocks, meta, scale)


def _paged_batch(dtype, block_size, seqs, num_heads=6, num_kv_heads=2, head_dim=64):
    """Random blocks, q and block tables (shuffled block ids) for seqs [(num_new, context_len)]."""
    num_blocks = sum((length + block_size - 1) // block_size for _, length in seqs) + 8
    k_blocks = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    v_blocks = torch.randn(num_blocks, num_kv_heads, block_size, head_dim).to(dtype)
    max_blocks = max((length + block_size - 1) // block_size for _, length in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    free = torch.randperm(num_blocks).tolist()
    for i, (_, length) in enumerate(seqs):
        for b in range((length + block_size - 1) // block_size):
            tables[i, b] = free.pop()
    query_start_loc = [0]
    for num_new, _ in seqs:
        query_start_loc.append(query_start_loc[-1] + num_new)
    q = torch.randn(query_start_loc[-1], num_heads, head_dim).to(dtype)
    return q, k_blocks, v_blocks, tables, query_start_loc, [length for _, length in seqs]


# Decode, verification, a whole prompt, a chunk after a cached prefix crossing 256-key splits,
# a one-key sequence.
_PAGED_SEQS = [(1, 300), (5, 40), (37, 37), (1, 1), (3, 600), (270, 530)]


def _gathered(blocks: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's keys (or values) from its blocks: [num_blocks, kv_heads, block_size, D] ->
    [kv_heads, length, D], contiguous."""
    return blocks[table].transpose(0, 1).flatten(1, 2)[:, :length].contiguous()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [2, 16, 64])
def test_paged_attention_matches_twin_and_any_block_layout(dtype, tol, block_size):
    torch.manual_seed(block_size)
    q, k_blocks, v_blocks, tables, query_start_loc, context_lens = _paged_batch(dtype, block_size, _PAGED_SEQS)
    out = _attend(q, k_blocks, v_blocks, tables, query_start_loc, context_lens, 0.125)
    twin = _twin(q, k_blocks, v_blocks, tables, query_start_loc, context_lens, 0.125)
    assert (out.float() - twin.float()).abs().max().item() <= tol
    num_kv_heads, head_dim = k_blocks.shape[1], k_blocks.shape[3]
    for i, (num_new, length) in enumerate(_PAGED_SEQS):
        # The same keys alone in one contiguous block (the smallest power of two that holds
        # them): the kernel only addresses keys through the table, so every row is the same bits.
        table = tables[i, :(length + block_size - 1) // block_size]
        one_block = 1 << max(1, (length - 1).bit_length())
        k = torch.zeros(1, num_kv_heads, one_block, head_dim, dtype=dtype)  # [1 block, kv_heads, one_block, D]
        v = torch.zeros_like(k)
        k[0, :, :length], v[0, :, :length] = _gathered(k_blocks, table, length), _gathered(v_blocks, table, length)
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        alone = _attend(q[rows], k, v, torch.zeros(1, 1, dtype=torch.long), [0, num_new], [length],
                                      0.125)
        assert torch.equal(out[rows], alone), f"sequence {i}"


# (num_seqs, kv_heads, group, head_dim, context_len, num_new): decode steps at head dims 16 to
# 128 over 1 to 5 fixed 256-key splits with tails; verification of a few tokens; a whole prompt
# (num_new == context_len).
_SDPA_SHAPES = [(1, 2, 6, 128, 1030, 1), (2, 3, 1, 64, 5, 1), (1, 1, 9, 32, 600, 1), (1, 2, 14, 64, 257, 1),
                (1, 2, 3, 48, 37, 1), (1, 1, 2, 16, 300, 1), (1, 1, 4, 80, 16, 1), (1, 2, 6, 128, 1030, 5),
                (1, 2, 7, 64, 300, 8), (2, 1, 3, 48, 257, 2), (1, 1, 1, 32, 9, 9)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", _SDPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_paged_attention_matches_masked_sdpa_and_one_token_calls(dtype, tol, shape):
    # The definition: each new token attends over the keys up to its own, in fp32; and each
    # token's row equals its own one-token step, as speculative verification needs.
    num_seqs, kv_heads, group, d, length, num_new = shape
    torch.manual_seed(length)
    q, k_blocks, v_blocks, tables, query_start_loc, context_lens = _paged_batch(
        dtype, 16, [(num_new, length)] * num_seqs, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=d)
    scale = d ** -0.5
    out = _attend(q, k_blocks, v_blocks, tables, query_start_loc, context_lens, scale)
    twin = _twin(q.float(), k_blocks.float(), v_blocks.float(), tables, query_start_loc,
                                           context_lens, scale)
    table_len = (length + 15) // 16
    mask = torch.arange(length) <= torch.arange(length - num_new, length)[:, None]  # [num_new, keys]
    for i in range(num_seqs):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        k = _gathered(k_blocks, tables[i, :table_len], length).float()  # [kv_heads, length, D]
        v = _gathered(v_blocks, tables[i, :table_len], length).float()
        expected = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True).transpose(0, 1)  # [num_new, heads, D]
        assert (out[rows].float() - expected).abs().max().item() <= tol
        assert (twin[rows] - expected).abs().max().item() <= 1e-5
        for t in range(num_new):
            row = query_start_loc[i] + t
            one = _attend(q[row:row + 1], k_blocks, v_blocks, tables[i:i + 1], [0, 1],
                                        [length - num_new + t + 1], scale)
            assert torch.equal(out[row], one[0]), f"sequence {i}, token {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_rows_do_not_depend_on_the_batch(dtype):
    # A token's row is the same alone (a decode step), in a chunk of its prompt, or beside
    # other sequences: batch invariance of the attention.
    torch.manual_seed(1)
    q, k_blocks, v_blocks, tables, query_start_loc, context_lens = _paged_batch(dtype, 16, _PAGED_SEQS)
    out = _attend(q, k_blocks, v_blocks, tables, query_start_loc, context_lens, 0.125)
    i = len(_PAGED_SEQS) - 1  # the 270-token chunk ending at key 530
    num_new, length = _PAGED_SEQS[i]
    for t in (0, 100, num_new - 1):
        row = query_start_loc[i] + t
        alone = _attend(q[row:row + 1], k_blocks, v_blocks, tables[i:i + 1], [0, 1],
                                      [length - num_new + t + 1], 0.125)
        assert torch.equal(alone[0], out[row])
    split = 40  # the same chunk as two chunks
    first = _attend(q[query_start_loc[i]:query_start_loc[i] + split], k_blocks, v_blocks,
                                  tables[i:i + 1], [0, split], [length - num_new + split], 0.125)
    assert torch.equal(first, out[query_start_loc[i]:query_start_loc[i] + split])


def test_paged_attention_rejects_bad_metadata():
    q, k_blocks, v_blocks, tables, query_start_loc, context_lens = _paged_batch(torch.float32, 16, [(2, 20)])
    with pytest.raises(RuntimeError, match="new tokens"):
        _attend(q, k_blocks, v_blocks, tables, query_start_loc, [1], 0.125)
    with pytest.raises(RuntimeError, match="block id"):
        _attend(q, k_blocks, v_blocks, tables + 1000, query_start_loc, context_lens, 0.125)


def _has_dense_bf16() -> bool:
    ext = load_cpu_kernels()
    return ext is not None and ext.dense_bf16_applies(torch.zeros(1, 32, dtype=torch.bfloat16),
                                                      torch.zeros(1, 32, dtype=torch.bfloat16))


needs_dense_bf16 = pytest.mark.skipif(not _has_dense_bf16(), reason="needs AVX512-BF16")


@needs_dense_bf16
@pytest.mark.parametrize("n, k", [(37, 64), (256, 1536), (4099, 96)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_dense_bf16_kernel_matches_twin_and_is_row_invariant(n, k, has_bias):
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if has_bias else None
    x = torch.randn(8, k).bfloat16()
    one_row = [fused.dense_linear(x[m:m + 1], w, bias) for m in range(8)]  # [1, n] each
    for rows in range(1, 9):
        y = fused.dense_linear(x[:rows], w, bias)  # [rows, n]
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # fp32 sums in another order, one rounding each: at most a bf16 step apart
        torch.testing.assert_close(y.float(), fused.reference_dense_linear(x[:rows], w, bias).float(),
                                   rtol=2**-7, atol=1e-3 * k ** 0.5)
        for m in range(rows):
            assert torch.equal(y[m], one_row[m][0])


@needs_dense_bf16
@pytest.mark.parametrize("n, k", [(37, 64), (4099, 96)])
def test_dense_bf16_kernel_is_row_invariant_at_every_row_count_in_batch_invariant_mode(n, k):
    torch.manual_seed(1)
    w, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(203, k).bfloat16()
    one_row = fused.dense_linear(x[150:151], w, bias)  # [1, n]
    with batch_invariant():
        for rows in (9, 17, 203):
            y = fused.dense_linear(x[:rows], w, bias)  # [rows, n]
            torch.testing.assert_close(y.float(), fused.reference_dense_linear(x[:rows], w, bias).float(),
                                       rtol=2**-7, atol=1e-3 * k ** 0.5)
            assert torch.equal(y[:8], fused.dense_linear(x[:8], w, bias))
        assert torch.equal(y[150], one_row[0])
        with batch_invariant(False):  # the mode is scoped: oneDNN runs large row counts again
            assert torch.equal(fused.dense_linear(x, w, bias), F.linear(x, w, bias))


def test_dense_linear_falls_back_to_f_linear():
    torch.manual_seed(0)
    w, x = torch.randn(16, 40).bfloat16(), torch.randn(3, 40).bfloat16()  # K % 32 != 0
    assert torch.equal(fused.dense_linear(x, w), F.linear(x, w))
    w, x = torch.randn(16, 64).bfloat16(), torch.randn(9, 64).bfloat16()  # more than 8 rows
    assert torch.equal(fused.dense_linear(x, w), F.linear(x, w))
    assert torch.equal(fused.dense_linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    w.requires_grad_(True)  # autograd needs torch's op
    assert fused.dense_linear(x[:2], w).grad_fn is not None


@needs_dense_bf16
def test_linear_module_runs_the_kernel_with_nn_linear_state():
    from torch import nn

    from fastdraft.layers.linear import Linear

    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True, dtype=torch.bfloat16)
    ref = nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    assert lin.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(2, 3, 64).bfloat16()  # leading dims kept
    with torch.no_grad():
        assert torch.equal(lin(x), fused.dense_linear(x, lin.weight, lin.bias))
        assert lin(x).shape == (2, 3, 48)


def test_fallback_when_disabled(monkeypatch):
    monkeypatch.setenv("FASTDRAFT_DISABLE_CPU_KERNELS", "1")
    clear_caches()
    try:
        assert load_cpu_kernels() is None
        qw = quantize(torch.randn(64, 256), 4, 128, sym=True)
        assert select_kernel(qw, torch.bfloat16, "cpu").name != "x86"
        x = torch.randn(2, 8)
        assert torch.equal(activation_ops.silu_and_mul(x), activation_ops.reference_silu_and_mul(x))
        assert torch.equal(greedy_ids(x), x.argmax(dim=-1))  # numpy's argmax instead
    finally:
        monkeypatch.delenv("FASTDRAFT_DISABLE_CPU_KERNELS")
        clear_caches()
    assert load_cpu_kernels() is not None


@pytest.mark.parametrize("n", [1, 15, 16, 17, 47, 300, 151936])
def test_argmax_rows_matches_torch_argmax(n):
    """argmax_rows against its twin torch.argmax: ties, NaN and infinities in the vector part
    and in the tail, rows of one value, and shapes of 1 to 3 dims."""
    ext = load_cpu_kernels()
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(9, n, generator=gen)
    rows[1] = 0.5  # all tied: the first index
    rows[2] = float("-inf")
    rows[3, n // 2] = float("inf")
    rows[3, n - 1] = float("inf")  # a tie of infinities: the first
    rows[4, n - 1] = float("nan")  # a NaN in the tail beats every number
    rows[5, n // 3] = float("nan")
    rows[5, n - 1] = float("nan")  # two NaNs: the first
    rows[6, 0] = rows[6].max() + 1
    rows[6, -1] = rows[6, 0]  # a tie between the ends
    rows[7, n - 1] = rows[7].max() + 1  # the maximum in the tail
    rows[8, n // 2] = -0.0  # signed zeros compare equal
    for x in (rows, rows[0], rows.view(3, 3, n), rows.t().contiguous().t()):
        assert torch.equal(ext.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_rejects_other_dtypes():
    with pytest.raises(RuntimeError, match="fp32"):
        load_cpu_kernels().argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
