"""Triton kernels of a block-sparse Linear ``Y = X W^T`` with ``W`` in ``R x C`` blocks.

Two kernels serve the three products (stk's dsd / sdd split):

* :func:`_dense_sparse_kernel`: ``OUT[M, segments * NB] = A[M, :] @ S`` where each
  segment (an output block column) sums over its kept blocks. The forward pass runs it
  over block rows (``A = X``, blocks read transposed, ``NB = R``); the input gradient
  over block columns (``A = dY``, blocks read as stored, ``NB = C``).
* :func:`_sampled_dense_dense_kernel`: the weight gradient at kept blocks only,
  ``dV[p] = dY[:, rows(p)]^T @ X[:, cols(p)]``, one program per kept block and token
  chunk; the chunks' fp32 partial sums are added in a fixed order, so every kernel here
  is deterministic (no atomics).

Loads are masked at the token and feature tails, so any token count and feature size
works; where the reduction width is not a multiple of the block (``K_TAIL``), the block
entries past it (padding of ``values``) are masked too, so no output depends on them, NaN
there included. The launchers take operands of any strides: the kernels read ``x`` and
``dY`` by row stride with unit feature stride, and ``values``, ``bias`` and the index
tensors contiguous, so an operand is copied (``.contiguous()``) only where it is not so
already. The tile sizes are tuned per shape bucket over :func:`block_sparse_configs`; once
tuned, the GPU launches the compiled kernel directly, by the launches kept per topology
(:meth:`~.launch.TunedKernel.launch_by`, keyed by the token count, strides, dtypes, alignment).
``UPCAST``: Triton 3.9's interpreter multiplies 16-bit floats wrong in ``tl.dot``, so under
``TRITON_INTERPRET=1`` the operands are upcast to fp32 first (the GPU build never is).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from sparse_training.kernels._triton import interpret_mode, tl, triton
from sparse_training.kernels.block_sparse.launch import TunedKernel, alignment
from sparse_training.kernels.block_sparse.topology import (
    KERNEL_DTYPES,
    BlockTopology,
    check_operands,
)

_INTERPRET = interpret_mode()  # fixed at import, as Triton fixes its kernels' mode


def block_sparse_configs(op: str) -> list[triton.Config]:
    """Autotune candidates of one op: ``"dsd"`` (token tile ``BLOCK_M``, reduction step
    ``BK`` inside a block) or ``"sdd"`` (token step ``BLOCK_M``), with warps and stages.

    Under the interpreter one small config, so CI runs each kernel once.
    """
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BK": 16} if op == "dsd" else {"BLOCK_M": 32},
                              num_warps=4, num_stages=1)]
    if op == "dsd":
        shapes = [(64, 64, 4, 4), (128, 32, 4, 4), (128, 64, 4, 4), (128, 64, 8, 3),
                  (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4), (256, 128, 8, 2)]
        return [triton.Config({"BLOCK_M": m, "BK": k}, num_warps=w, num_stages=s)
                for m, k, w, s in shapes]
    return [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=s)
            for m in (32, 64, 128) for w in (4, 8) for s in (3, 4)]


def _fits_block(configs, named_args, **meta) -> list[triton.Config]:
    """Clamp ``BK`` to the block and drop configs whose pipelined tiles exceed Hopper's
    227 KiB of shared memory: stages x element x the tiles of one step, ``BLOCK_M x BK +
    BK x NB`` (dense x sparse) or ``BLOCK_M x (R + C)`` (sampled dense-dense)."""
    element = named_args["a_ptr"].element_size()
    kept, seen = [], set()
    for config in configs:
        kwargs = dict(config.kwargs)
        if "BK" in kwargs:
            kwargs["BK"] = min(kwargs["BK"], meta["KB"])
            step = kwargs["BLOCK_M"] * kwargs["BK"] + kwargs["BK"] * meta["NB"]
        else:
            step = kwargs["BLOCK_M"] * (meta["R"] + meta["C"])
        tiles = config.num_stages * element * step
        signature = (tuple(sorted(kwargs.items())), config.num_warps, config.num_stages)
        if tiles <= 220 * 1024 and signature not in seen:
            seen.add(signature)
            kept.append(triton.Config(kwargs, num_warps=config.num_warps,
                                      num_stages=config.num_stages))
    return kept or configs[:1]


def _token_bucket(tokens: int) -> int:
    """Shape bucket of a token count for the autotune key (powers of two; not
    ``triton.next_power_of_2``, a constexpr function and slow to call from the host)."""
    return 1 << (max(tokens, 16) - 1).bit_length()


@triton.autotune(configs=block_sparse_configs("dsd"), key=["m_bucket", "KB", "NB", "USE_TMA"],
                 prune_configs_by={"early_config_prune": _fits_block})
@triton.heuristics({"EVEN": lambda args: args["M"] % args["BLOCK_M"] == 0
                    and args["a_width"] % args["KB"] == 0,
                    "K_TAIL": lambda args: args["a_width"] % args["KB"] != 0})
@triton.jit
def _dense_sparse_kernel(a_ptr, v_ptr, out_ptr, bias_ptr, offsets_ptr, indices_ptr, ids_ptr,
                         M, a_width, out_width, segments, value_rows, m_bucket,
                         stride_am, stride_om,
                         KB: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr,
                         BK: tl.constexpr, EVEN: tl.constexpr, K_TAIL: tl.constexpr,
                         GROUP_M: tl.constexpr,
                         TRANS_B: tl.constexpr, USE_TMA: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_IDS: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # grouped order: GROUP_M token tiles sweep the segments together, so a group's A rows
    # and the blocks of the segments in flight stay in L2
    pid = tl.program_id(0)
    group_width = GROUP_M * segments
    first_m = (pid // group_width) * GROUP_M
    group_size = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    m_tile = first_m + (pid % group_width) % group_size
    segment = (pid % group_width) // group_size
    start = tl.load(offsets_ptr + segment)
    end = tl.load(offsets_ptr + segment + 1)
    rm = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BK)
    rn = tl.arange(0, NB)
    # blocks are stored (R, C) row-major: the forward (TRANS_B) reads each as (C, R)
    v_stride_k: tl.constexpr = 1 if TRANS_B else NB
    v_stride_n: tl.constexpr = KB if TRANS_B else 1
    if USE_TMA:  # Hopper's copy engine: bounds handled by the descriptors (zero fill)
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, a_width], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, BK])
        if TRANS_B:
            v_desc = tl.make_tensor_descriptor(v_ptr, shape=[value_rows, KB], strides=[KB, 1],
                                               block_shape=[NB, BK])
        else:
            v_desc = tl.make_tensor_descriptor(v_ptr, shape=[value_rows, NB], strides=[NB, 1],
                                               block_shape=[BK, NB])
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, NB), dtype=tl.float32)
    # one flat loop over (kept block, BK-chunk of it): more steps for the pipeliner
    for step in range(start * (KB // BK), end * (KB // BK)):
        p = step // (KB // BK)
        k_offset = (step % (KB // BK)) * BK
        k_block = tl.load(indices_ptr + p)
        block_id = tl.load(ids_ptr + p) if HAS_IDS else p
        cols = k_block * KB + k_offset + rk  # reduction index: a's columns, b's rows
        if USE_TMA:
            a = a_desc.load([m_tile * BLOCK_M, k_block * KB + k_offset])
            if TRANS_B:
                b = v_desc.load([block_id * NB, k_offset]).T
            else:
                b = v_desc.load([block_id * KB + k_offset, 0])
            if K_TAIL:  # the block's padding past the reduction width: zeros, not 0 * NaN
                b = tl.where(cols[:, None] < a_width, b, 0.0)
        else:
            if EVEN:
                a = tl.load(a_rows + cols[None, :])
            else:
                a = tl.load(a_rows + cols[None, :],
                            mask=(rm[:, None] < M) & (cols[None, :] < a_width), other=0.0)
            b_ptrs = (v_ptr + block_id.to(tl.int64) * (KB * NB)
                      + (k_offset + rk)[:, None] * v_stride_k + rn[None, :] * v_stride_n)
            if K_TAIL:
                b = tl.load(b_ptrs, mask=cols[:, None] < a_width, other=0.0)
            else:
                b = tl.load(b_ptrs)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out_cols = segment * NB + rn
    if HAS_BIAS:
        acc += tl.load(bias_ptr + out_cols, mask=out_cols < out_width, other=0.0)[None, :]
    if USE_TMA:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, out_width],
                                             strides=[stride_om, 1], block_shape=[BLOCK_M, NB])
        out_desc.store([m_tile * BLOCK_M, segment * NB], acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + out_cols[None, :],
                 acc.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (out_cols[None, :] < out_width))


@triton.autotune(configs=block_sparse_configs("sdd"), key=["m_bucket", "R", "C", "USE_TMA"],
                 prune_configs_by={"early_config_prune": _fits_block})
@triton.jit
def _sampled_dense_dense_kernel(a_ptr, b_ptr, out_ptr, rows_ptr, cols_ptr,
                                M, a_width, b_width, nnz, chunk, m_bucket,
                                stride_am, stride_bm,
                                R: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr,
                                USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
                                UPCAST: tl.constexpr):
    p = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.load(rows_ptr + p)
    col_block = tl.load(cols_ptr + p)
    rr = row_block * R + tl.arange(0, R)
    rc = col_block * C + tl.arange(0, C)
    acc = tl.zeros((R, C), dtype=tl.float32)
    if USE_TMA:  # chunks are whole token tiles: the descriptors' bounds are the tails
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, a_width], strides=[stride_am, 1],
                                           block_shape=[BLOCK_M, R])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[M, b_width], strides=[stride_bm, 1],
                                           block_shape=[BLOCK_M, C])
    m_end = tl.minimum(split * chunk + chunk, M)
    for m0 in range(split * chunk, m_end, BLOCK_M):
        if USE_TMA:
            a_t = a_desc.load([m0, row_block * R]).T
            b = b_desc.load([m0, col_block * C])
        else:
            rm = m0 + tl.arange(0, BLOCK_M)
            in_tokens = rm < m_end
            a_t = tl.load(a_ptr + rm.to(tl.int64)[None, :] * stride_am + rr[:, None],
                          mask=in_tokens[None, :] & (rr[:, None] < a_width), other=0.0)
            b = tl.load(b_ptr + rm.to(tl.int64)[:, None] * stride_bm + rc[None, :],
                        mask=in_tokens[:, None] & (rc[None, :] < b_width), other=0.0)
        if UPCAST:
            a_t, b = a_t.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a_t, b, acc, input_precision=PRECISION)
    offsets = (split * nnz + p).to(tl.int64) * (R * C)
    local = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(out_ptr + offsets + local, acc.to(out_ptr.dtype.element_ty))


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs use TF32 exactly when torch's own fp32 matmuls do."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 \
        else "ieee"


def _tma_allocator(size: int, alignment: int, stream) -> Tensor:
    """Global scratch for the descriptors the kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if _INTERPRET else "cuda")


def _tma_aligned(*tensors: Tensor) -> bool:
    """Whether tensor descriptors can address ``tensors``: 16-byte aligned bases and row
    strides (``stride(-2)``), and rows that do not overlap."""
    bits = 0
    for t in tensors:
        if t.stride(-2) < t.shape[-1]:
            return False
        bits |= t.data_ptr() | t.stride(-2) * t.element_size()
    return bits % 16 == 0


def _use_tma(requested: bool | None, block: tuple[int, int], *tensors: Tensor) -> bool:
    """Whether this launch uses tensor descriptors: as ``requested``, or (None) where they
    serve: 128 x 128 blocks, a Hopper or newer GPU (or the interpreter) and
    :func:`_tma_aligned` operands.

    On an H100 descriptors made 128 x 128 blocks 10-30% faster on LLM shapes (up to 25%
    slower on BERT-large at 10%, a few microseconds) and 64 x 64 blocks up to 51% slower
    (``benchmarks/block_sparse_ops.py``).

    Raises:
        ValueError: ``requested`` True for operands descriptors cannot address.
    """
    if requested is None:
        requested = (min(block) >= 128
                     and (_INTERPRET or _major_capability(tensors[0].device.index) >= 9)
                     and _tma_aligned(*tensors))
    elif requested and not _tma_aligned(*tensors):
        raise ValueError("use_tma=True needs 16-byte aligned operands (base addresses and row "
                         "strides) with rows that do not overlap; leave use_tma=None to "
                         "choose per call")
    if requested:  # per call: Triton keeps the allocator per thread (the backward runs
        triton.set_allocator(_tma_allocator)  # on autograd's own thread)
    return requested


def _as_rows(t: Tensor) -> Tensor:
    """A 2-D operand as the kernels read it: unit stride along the features, any row
    stride; a contiguous copy only where ``t`` is not so (transposed, expanded views)."""
    rows, features = t.stride()
    return t if features == 1 and rows >= t.shape[1] else t.contiguous()


_DENSE_SPARSE = TunedKernel(
    _dense_sparse_kernel,
    lambda args: (args["segments"] * triton.cdiv(args["M"], args["BLOCK_M"]),))
_SAMPLED_DENSE_DENSE = TunedKernel(
    _sampled_dense_dense_kernel,
    lambda args: (args["nnz"], triton.cdiv(args["M"], args["chunk"])))


def _dense_sparse(a: Tensor, values: Tensor, bias: Tensor | None, topology: BlockTopology,
                  transposed_blocks: bool, use_tma: bool | None) -> Tensor:
    """``OUT = A @ S`` by :func:`_dense_sparse_kernel`, operands of any strides: over block
    rows (``transposed_blocks``, the forward) or block columns (the input gradient)."""
    a, values = _as_rows(a), values.contiguous()
    if transposed_blocks:  # kept blocks in values' order: no block ids (a placeholder)
        (nb, kb), out_width = topology.block, topology.out_features
        index = (topology.row_offsets, topology.col_indices, topology.col_indices)
    else:
        (kb, nb), out_width = topology.block, topology.in_features
        index = (topology.t_offsets, topology.t_row_indices, topology.t_block_ids)
    out = a.new_empty(tokens := a.shape[0], out_width)
    if tokens == 0:
        return out
    use_tma = _use_tma(use_tma, (kb, nb), a, out, values)
    operands = (a, values, out, values if bias is None else bias.contiguous())
    precision = _precision(a.dtype)
    _DENSE_SPARSE.launch_by(  # keyed by what the topology does not fix
        topology, (transposed_blocks, tokens, a.shape[1], a.stride(0), a.dtype, values.dtype,
                   bias is None or bias.dtype, use_tma, precision, alignment(operands)),
        operands + index,
        lambda: ((tokens, a.shape[1], out_width, index[0].shape[0] - 1,
                  values.shape[0] * values.shape[1], _token_bucket(tokens), a.stride(0),
                  out_width),  # out is contiguous
                 dict(KB=kb, NB=nb, GROUP_M=8, TRANS_B=transposed_blocks, USE_TMA=use_tma,
                      HAS_BIAS=bias is not None, HAS_IDS=not transposed_blocks,
                      PRECISION=precision, UPCAST=_INTERPRET)))
    return out


def launch_forward(x: Tensor, values: Tensor, topology: BlockTopology,
                   bias: Tensor | None, use_tma: bool | None = None) -> Tensor:
    """``Y = X W^T + b`` for a 2-D ``x`` (any strides): one program per (block row, token
    tile). The result is a new contiguous ``(tokens, out_features)`` tensor.

    ``use_tma``: tensor descriptors (Hopper's copy engine) or plain loads; None = where
    they can serve (:func:`_use_tma`).

    Raises:
        ValueError: an operand that does not fit (:func:`~.topology.check_operands`).
    """
    check_operands(topology, values=values, x=x, bias=bias, kernel=True)
    return forward_product(x, values, topology, bias, use_tma)


def forward_product(x: Tensor, values: Tensor, topology: BlockTopology, bias: Tensor | None,
                    use_tma: bool | None = None) -> Tensor:
    """:func:`launch_forward` without its checks, for operands that are known to fit (a
    compiled graph's: the custom op's fake implementation checked them when it traced)."""
    return _dense_sparse(x, values, bias, topology, transposed_blocks=True, use_tma=use_tma)


def launch_input_grad(grad_out: Tensor, values: Tensor, topology: BlockTopology,
                      use_tma: bool | None = None) -> Tensor:
    """``dX = dY W`` (any strides): one program per (block column, token tile); a new
    contiguous ``(tokens, in_features)`` tensor.

    Raises:
        ValueError: an operand that does not fit (:func:`~.topology.check_operands`).
    """
    check_operands(topology, values=values, grad_out=grad_out, kernel=True)
    return input_grad_product(grad_out, values, topology, use_tma)


def input_grad_product(grad_out: Tensor, values: Tensor, topology: BlockTopology,
                       use_tma: bool | None = None) -> Tensor:
    """:func:`launch_input_grad` without its checks, for operands that are known to fit
    (the backward of a checked forward: autograd gives ``grad_out`` the output's shape,
    dtype and device)."""
    return _dense_sparse(grad_out, values, None, topology, transposed_blocks=False,
                         use_tma=use_tma)


@functools.cache
def _major_capability(device_index: int | None) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


@functools.cache
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _token_splits(tokens: int, nnz: int, device: torch.device) -> tuple[int, int]:
    """(tokens per chunk, chunks): split the token sum of the weight gradient until about
    two waves of programs fill the GPU, each chunk at least 512 tokens."""
    programs = 2 * (132 if _INTERPRET else _multiprocessors(device.index))
    splits = max(1, min(triton.cdiv(programs, max(nnz, 1)), tokens // 512))
    chunk = triton.cdiv(triton.cdiv(tokens, splits), 256) * 256
    return chunk, triton.cdiv(tokens, chunk)


def launch_weight_grad(grad_out: Tensor, x: Tensor, topology: BlockTopology,
                       dtype: torch.dtype, use_tma: bool | None = None) -> Tensor:
    """``dV[p] = dY[:, rows(p)]^T X[:, cols(p)]`` at kept blocks (any strides), as a new
    contiguous ``[nnz, R, C]`` tensor of ``dtype`` (rounded once from the fp32 sums);
    exactly 0 where a block hangs over the weight's edge.

    Raises:
        ValueError: an operand that does not fit (:func:`~.topology.check_operands`), or
            ``dtype`` not one of :data:`~.topology.KERNEL_DTYPES`.
    """
    check_operands(topology, x=x, grad_out=grad_out, kernel=True)
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype {dtype!r} of the weight gradient is not one of "
                         f"{KERNEL_DTYPES}: pass values.dtype")
    return weight_grad_product(grad_out, x, topology, dtype, use_tma)


def weight_grad_product(grad_out: Tensor, x: Tensor, topology: BlockTopology,
                        dtype: torch.dtype, use_tma: bool | None = None) -> Tensor:
    """:func:`launch_weight_grad` without its checks, for operands that are known to fit
    (:func:`input_grad_product`)."""
    (r, c), nnz, tokens = topology.block, topology.nnz, x.shape[0]
    if tokens == 0 or nnz == 0:
        return x.new_zeros((nnz, r, c), dtype=dtype)
    grad_out, x = _as_rows(grad_out), _as_rows(x)
    chunk, splits = _token_splits(tokens, nnz, x.device)
    partial = x.new_empty((splits, nnz, r, c), dtype=torch.float32 if splits > 1 else dtype)
    use_tma = _use_tma(use_tma, (r, c), grad_out, x)
    operands, precision = (grad_out, x, partial), _precision(x.dtype)
    _SAMPLED_DENSE_DENSE.launch_by(  # keyed as _dense_sparse's
        topology, (tokens, grad_out.shape[1], x.shape[1], grad_out.stride(0), x.stride(0),
                   grad_out.dtype, x.dtype, partial.dtype, chunk, use_tma, precision,
                   alignment(operands)),
        (*operands, topology.row_indices, topology.col_indices),
        lambda: ((tokens, grad_out.shape[1], x.shape[1], nnz, chunk, _token_bucket(tokens),
                  grad_out.stride(0), x.stride(0)),
                 dict(R=r, C=c, USE_TMA=use_tma, PRECISION=precision, UPCAST=_INTERPRET)))
    return partial[0] if splits == 1 else partial.sum(0).to(dtype)
