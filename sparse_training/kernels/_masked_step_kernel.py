"""The Triton kernel of the fused masked optimizer step (``masked_step`` launches it).

Each program takes chunks of the multi-tensor table (``_multi_tensor``): a row per tensor
holds the addresses of param, grad, the two state tensors and the mask, the element count,
and the device step counter's address or the per-tensor bias corrections. Per element:
``g = mask * grad / scale``; Adam(W) ``m += (1 - beta1)(g - m)``, ``v = beta2 v +
(1 - beta2) g^2``, ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``
with decoupled (``p *= 1 - lr wd``) or L2 weight decay (Kingma & Ba 2015; Loshchilov &
Hutter 2019); SGD with momentum, dampening and Nesterov as torch.optim.SGD. Pruned
positions of the weight and its state are stored as exact zeros.
"""

from __future__ import annotations

from ._triton import tl, triton

ADAM = tl.constexpr(0)
SGD = tl.constexpr(1)


@triton.jit
def _typed(table_row, column: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(table_row + column).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load(ptr, bound, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=bound, other=0)
    return tl.load(ptr)


@triton.jit
def _update_block(
    offs, numel, p_ptr, g_ptr, a_ptr, b_ptr, k_ptr,
    inv_scale, step_size, inv_bc2, lr, decay, weight_decay, one_minus_beta1, beta2,
    one_minus_beta2, eps, momentum, one_minus_dampening,
    ALGO: tl.constexpr, DECOUPLED: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr, SGD_FIRST: tl.constexpr, MASK_PACKED: tl.constexpr,
    MASKED: tl.constexpr, FAST: tl.constexpr, PARAM_DTYPE: tl.constexpr,
):  # fmt: skip
    bound = offs < numel if MASKED else None
    if MASK_PACKED:
        byte = _load(k_ptr + (offs >> 3), bound, MASKED).to(tl.int32)
        keep = ((byte >> (offs & 7).to(tl.int32)) & 1) != 0
    else:
        keep = _load(k_ptr + offs, bound, MASKED) != 0
    g = _load(g_ptr + offs, bound, MASKED).to(tl.float32)
    # FAST: inv_scale = sign / grad_scale, one division per program (exact for the
    # power-of-two scales of GradScaler); else grad_scale * sign, divided exactly.
    g = tl.where(keep, g * inv_scale if FAST else tl.div_rn(g, inv_scale), 0.0)
    p = _load(p_ptr + offs, bound, MASKED).to(tl.float32)
    if ALGO == ADAM:
        if DECOUPLED:
            p = p * decay
        else:
            g = g + weight_decay * p
        m = _load(a_ptr + offs, bound, MASKED).to(tl.float32)
        v = _load(b_ptr + offs, bound, MASKED).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        if FAST:
            # inv_bc2 = 1 / sqrt(1 - beta2^t); approximate sqrt and division (~2 ulp).
            p = p - step_size * m / (tl.sqrt(v) * inv_bc2 + eps)
        else:
            # inv_bc2 holds sqrt(1 - beta2^t) itself here, divided as torch does.
            denom = tl.div_rn(tl.sqrt_rn(v), inv_bc2) + eps
            p = p - step_size * tl.div_rn(m, denom)
        tl.store(a_ptr + offs, tl.where(keep, m, 0.0).to(PARAM_DTYPE), mask=bound)
        tl.store(b_ptr + offs, tl.where(keep, v, 0.0).to(PARAM_DTYPE), mask=bound)
    else:
        g = g + weight_decay * p
        if HAS_MOMENTUM:
            if SGD_FIRST:
                buf = g
            else:
                buf = _load(a_ptr + offs, bound, MASKED).to(tl.float32)
                buf = buf * momentum + one_minus_dampening * g
            tl.store(a_ptr + offs, tl.where(keep, buf, 0.0).to(PARAM_DTYPE), mask=bound)
            g = g + momentum * buf if NESTEROV else buf
        p = p - lr * g
    tl.store(p_ptr + offs, tl.where(keep, p, 0.0).to(PARAM_DTYPE), mask=bound)


@triton.jit
def masked_step_kernel(
    table, tensor_index, chunk_index, n_chunks, grad_scale_ptr, found_inf_ptr,
    grad_sign, lr, step_size_all, bc2_all, decay, weight_decay, one_minus_beta1, beta2,
    one_minus_beta2, log2_beta1, log2_beta2, eps, momentum, one_minus_dampening,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, ALGO: tl.constexpr,
    DECOUPLED: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, SGD_FIRST: tl.constexpr,
    MASK_PACKED: tl.constexpr, STEP_ON_DEVICE: tl.constexpr, BC_PER_TENSOR: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr,
    FAST: tl.constexpr, COLUMNS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    live = True
    if HAS_FOUND_INF:
        live = tl.load(found_inf_ptr) == 0
    if live:
        inv_scale = grad_sign
        if HAS_SCALE:
            if FAST:
                inv_scale = grad_sign / tl.load(grad_scale_ptr)
            else:
                inv_scale = tl.load(grad_scale_ptr) * grad_sign
        # Persistent when the grid is smaller than the chunk list: stride over it.
        for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
            row = table + tl.load(tensor_index + c) * COLUMNS
            first = tl.load(chunk_index + c) * CHUNK
            numel = tl.load(row + 5)
            p_ptr = _typed(row, 0, PARAM_DTYPE, ALIGNED)
            g_ptr = _typed(row, 1, GRAD_DTYPE, ALIGNED)
            a_ptr = _typed(row, 2, PARAM_DTYPE, ALIGNED)
            b_ptr = _typed(row, 3, PARAM_DTYPE, ALIGNED)
            k_ptr = _typed(row, 4, tl.int8, ALIGNED)
            step_size = lr
            inv_bc2 = 1.0
            if ALGO == ADAM:
                if STEP_ON_DEVICE:
                    # Like torch's fused Adam: bias corrections from the device step, in fp32.
                    step = tl.load(tl.load(row + 6).to(tl.pointer_type(tl.float32)))
                    step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
                    if FAST:
                        inv_bc2 = 1.0 / tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
                    else:
                        inv_bc2 = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
                elif BC_PER_TENSOR:
                    # Steps differ between tensors: host float64 values, as fp32 bits.
                    step_size = tl.load(row + 6).to(tl.int32).to(tl.float32, bitcast=True)
                    inv_bc2 = tl.load(row + 7).to(tl.int32).to(tl.float32, bitcast=True)
                else:
                    step_size = step_size_all
                    inv_bc2 = bc2_all
            offs = first + tl.arange(0, BLOCK)
            if first + CHUNK <= numel:
                for start in range(0, CHUNK, BLOCK):
                    _update_block(
                        offs + start, numel, p_ptr, g_ptr, a_ptr, b_ptr, k_ptr,
                        inv_scale, step_size, inv_bc2, lr, decay, weight_decay,
                        one_minus_beta1, beta2, one_minus_beta2, eps, momentum,
                        one_minus_dampening, ALGO, DECOUPLED, HAS_MOMENTUM, NESTEROV,
                        SGD_FIRST, MASK_PACKED, False, FAST, PARAM_DTYPE,
                    )  # fmt: skip
            else:
                for tail in range(0, numel - first, BLOCK):
                    _update_block(
                        offs + tail, numel, p_ptr, g_ptr, a_ptr, b_ptr, k_ptr,
                        inv_scale, step_size, inv_bc2, lr, decay, weight_decay,
                        one_minus_beta1, beta2, one_minus_beta2, eps, momentum,
                        one_minus_dampening, ALGO, DECOUPLED, HAS_MOMENTUM, NESTEROV,
                        SGD_FIRST, MASK_PACKED, True, FAST, PARAM_DTYPE,
                    )  # fmt: skip
