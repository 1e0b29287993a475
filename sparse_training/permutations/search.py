"""Channel-permutation search for N:M sparsity (Pool & Yu, NeurIPS 2021).

N:M magnitude pruning keeps the N largest ``|w|`` of every M consecutive input columns of
a row, so which columns share a group decides what survives. A permutation ``perm`` of
the input channels regroups them: ``weight[:, perm]`` keeps

    kept(perm) = sum_rows sum_groups topN(|w[row, perm[group]]|)

and the network computes the same function once the producer's outputs are permuted
alike (:mod:`sparse_training.permutations`). Weights are read through
:func:`sparse_training.pieces.masks.as_matrix`, ``(rows, in)`` with Conv kernel taps as rows,
so the permutation acts on the dimension the N:M groups run along.
"""

from __future__ import annotations

import math
import numbers
import time

import torch
from torch import Tensor

from sparse_training.pieces.masks import as_matrix

WINDOW_WORK = 2**30  # |x - t| terms in one window's first swap map: about 1 s on 2 CPU cores
MAX_WINDOW = 4096  # columns; the swap map is (window x window) float64, 128 MiB at 4096
MIN_PASS_GAIN = 0.01  # windows are reshuffled while a pass adds this fraction of the gain
TOLERANCE = 1e-9  # a swap must gain this fraction of a mean column's magnitude


def check_seconds(value: float | None, name: str) -> float:
    """A search budget in seconds: None (converge) as inf, else a number >= 0 (0: no
    search); ValueError naming ``name`` for anything else (negative, NaN, not a number)."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 or None (search until "
                         f"converged), got {value!r}")
    return float(value)


def _check_nm(weight: Tensor, n: int, m: int) -> Tensor:
    """``|weight|`` as a float64 ``(rows, in)`` matrix, after checking that N:M fits it."""
    if isinstance(n, bool) or isinstance(m, bool) or not (
            isinstance(n, int) and isinstance(m, int) and 1 <= n <= m):
        raise ValueError(f"N:M needs integers 1 <= N <= M, got N={n!r}, M={m!r}")
    if weight.dim() < 2:
        raise ValueError(f"a permutation needs a weight with an input dimension (2-D or "
                         f"more), got shape {tuple(weight.shape)}")
    if weight.shape[1] % m:
        raise ValueError(f"weight of shape {tuple(weight.shape)}: {weight.shape[1]} input "
                         f"channels are not a multiple of M = {m}")
    return as_matrix(weight.detach()).abs().double()


def finite_problem(weight: Tensor) -> str | None:
    """Why ``weight`` cannot be searched (NaN or inf entries make every swap's gain NaN or
    inf), or None."""
    bad = int((~torch.isfinite(weight.detach())).sum())
    if not bad:
        return None
    return (f"weight of shape {tuple(weight.shape)} has {bad} non-finite "
            f"{'entry' if bad == 1 else 'entries'} (NaN or inf); a permutation search needs "
            f"finite weights")


def _kept(a: Tensor, n: int, m: int) -> float:
    """Kept magnitude of a non-negative ``(rows, in)`` matrix ``a``."""
    return a.reshape(a.shape[0], -1, m).topk(n, dim=-1).values.sum().item()


def kept_magnitude(weight: Tensor, n: int, m: int) -> float:
    """Sum of ``|w|`` that N:M magnitude pruning along the input dimension keeps.

    ``sum_rows sum_groups topN(|w[row, group]|)`` over groups of M consecutive input
    channels, in float64: the magnitude that :func:`sparse_training.pieces.masks.pattern_mask`
    keeps for ``f"{n}:{m}"`` (which ranks in float32, so exact ties may differ).

    Raises:
        ValueError: if N:M is not ``1 <= N <= M``, or the input channels are not a
            multiple of M.

    Example:
        >>> kept_magnitude(torch.tensor([[0.1, -3.0, 2.0, 0.5]]), 2, 4)
        5.0
    """
    return _kept(_check_nm(weight, n, m), n, m)


def _slot_terms(a: Tensor, n: int, m: int) -> tuple[Tensor, Tensor]:
    """For every slot s of ``a`` (R, S) grouped by M: ``loss[s]``, the kept magnitude its
    group loses without it, and ``floor[:, s]``, the N-th largest of the other M - 1 per row.

    A column x put into slot s keeps ``sum_r relu(x_r - floor[r, s]) - loss[s]`` more.
    """
    rows, slots = a.shape
    groups = a.view(rows, slots // m, m)
    others = torch.tensor([[j for j in range(m) if j != i] for i in range(m)],
                          device=a.device)  # (M, M-1)
    top = groups[:, :, others].topk(n, dim=-1).values  # (R, S/M, M, N), descending
    kept = groups.topk(n, dim=-1).values.sum(-1, keepdim=True)  # (R, S/M, 1)
    loss = (kept - top.sum(-1)).sum(0).reshape(slots)
    return loss, top[..., -1].reshape(rows, slots)


def _gain_rows(cur: Tensor, groups: Tensor, n: int, m: int) -> Tensor:
    """``D[s, t]`` for the slots s of ``groups`` of ``cur`` (R, C): what s's group gains if
    the column now at slot t replaces the one at s. ``sum_r relu(x - t) =
    (sum x - sum t + sum |x - t|) / 2`` turns the relu sums into one ``torch.cdist`` (p=1)."""
    slots = (groups[:, None] * m + torch.arange(m, device=cur.device)).reshape(-1)
    loss, floor = _slot_terms(cur[:, slots], n, m)  # (k,), (R, k)
    l1 = torch.cdist(floor.T.contiguous(), cur.T.contiguous(), p=1)  # (k, C)
    return (cur.sum(0)[None, :] - floor.sum(0)[:, None] + l1) / 2 - loss[:, None]


def _best_swaps(gain_map: Tensor, groups: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The best swap between each of ``groups`` (k) and every group: its gain (k, G) and its
    index ``i * m + j`` (slot i of the first group, slot j of the second). Swapping slots p
    and q gains ``D[p, q] + D[q, p]``."""
    c = gain_map.shape[0]
    slots = (groups[:, None] * m + torch.arange(m, device=groups.device)).reshape(-1)
    rows = gain_map[slots].view(-1, m, c // m, m)  # [x, i, b, j] = D[x_i, b_j]
    cols = gain_map[:, slots].view(c // m, m, -1, m).permute(2, 3, 0, 1)  # D[b_j, x_i]
    return (rows + cols).transpose(1, 2).reshape(groups.numel(), c // m, m * m).max(dim=-1)


def _search_window(a: Tensor, n: int, m: int, deadline: float) -> Tensor:
    """Greedy channel swaps over the columns of ``a`` (R, C): a permutation of them."""
    c = a.shape[1]
    g = c // m
    perm = torch.arange(c, device=a.device)
    if g == 1:
        return perm
    cur, groups = a.clone(), torch.arange(g, device=a.device)
    within = torch.arange(m, device=a.device)
    gain_map = _gain_rows(cur, groups, n, m)  # (C, C)
    gains, idx = _best_swaps(gain_map, groups, m)  # (G, G) each, symmetric
    gains.fill_diagonal_(float("-inf"))
    tol = TOLERANCE * a.sum().item() / c
    while time.perf_counter() < deadline:
        value, partner = gains.max(dim=1)  # each group's best partner
        chosen = (partner[partner] == groups) & (groups < partner) & (value > tol)
        if not chosen.any():
            break
        first = groups[chosen]  # mutual best partners: disjoint pairs, so their gains add
        second = partner[first]
        p = first * m + idx[first, second] // m
        q = second * m + idx[first, second] % m
        swap = (torch.cat([p, q]), torch.cat([q, p]))
        perm[swap[0]], cur[:, swap[0]], gain_map[:, swap[0]] = (
            perm[swap[1]], cur[:, swap[1]], gain_map[:, swap[1]])
        changed = torch.cat([first, second])
        gain_map[(changed[:, None] * m + within).reshape(-1)] = _gain_rows(cur, changed, n, m)
        gains[changed], idx[changed] = _best_swaps(gain_map, changed, m)
        gains[:, changed], idx[:, changed] = gains[changed].T, (idx[changed] % m * m
                                                                + idx[changed] // m).T
        gains[changed, changed] = float("-inf")
    return perm


def search_permutation(weight: Tensor, n: int, m: int, *, seed: int = 0,
                       max_seconds: float | None = None) -> Tensor:
    """A permutation ``perm`` of the input channels such that N:M pruning of
    ``weight[:, perm]`` keeps at least the magnitude it keeps unpermuted.

    Greedy channel swaps (Pool & Yu 2021, "Channel Permutations for N:M Sparsity"; NVIDIA
    ASP's ``Channel_Swap``): every swap of a column of one group with a column of another
    is scored, the best ones are applied, and this repeats until no swap improves. With
    ``t_s[r]`` the N-th largest of row r of slot s's group without s, and ``loss_s`` the
    kept magnitude the group loses without s, putting column x into slot s gains

        D[s, x] = sum_r relu(|x_r| - t_s[r]) - loss_s,

    so a swap of slots p and q gains ``D[p, q] + D[q, p]``. The whole ``(C, C)`` map is
    one ``torch.cdist`` (p=1), O(C^2 R) for R rows. Each round applies the best swap of
    every pair of groups that are each other's best partner (disjoint pairs, so their
    gains add; the best swap overall is always among them), then rescores the changed
    groups only, O(M C R) per swap. Wide weights are searched in windows of at most
    ``sqrt(WINDOW_WORK / R)`` columns: whole groups shuffled into windows (seeded), and
    passes repeat while one adds ``MIN_PASS_GAIN`` of the gain so far.

    The search starts from the identity and accepts only improvements, so the result
    never keeps less. It is deterministic for a given ``seed`` and thread count when
    ``max_seconds`` is not reached. 2:4 on 2 CPU cores (docs/permutations.md): a few
    seconds for MiniLM's MLP weights (1536 x 384, 384 x 1536), and a 10 s budget
    gets most of the converged gain at BERT-large's (4096 x 1024, 1024 x 4096).

    Args:
        weight: a Linear ``(out, in)`` or Conv ``(out, in, *kernel)`` weight.
        n, m: N kept in every M consecutive input channels.
        seed: seeds the shuffles of the windows.
        max_seconds: stop after the round that passes this budget (None: converge; 0:
            the identity).

    Returns:
        A LongTensor permutation of ``range(in)`` on the weight's device.

    Raises:
        ValueError: if N:M is not ``1 <= N <= M``, the input channels are not a
            multiple of M, or the weight holds NaN or inf.

    Example:
        >>> w = torch.randn(64, 64)
        >>> perm = search_permutation(w, 2, 4)
        >>> kept_magnitude(w[:, perm], 2, 4) > kept_magnitude(w, 2, 4)
        True
    """
    a = _check_nm(weight, n, m)
    if problem := finite_problem(weight):
        raise ValueError(problem)
    deadline = time.perf_counter() + check_seconds(max_seconds, "max_seconds")
    rows, c = a.shape
    identity = torch.arange(c, device=a.device)
    if n == m or c == m:  # nothing pruned, or a single group
        return identity
    generator = torch.Generator().manual_seed(seed)
    per_window = max(2, min(MAX_WINDOW, int((WINDOW_WORK / rows) ** 0.5)) // m)  # groups
    perm, within = identity.clone(), torch.arange(m, device=a.device)
    start = kept = _kept(a, n, m)
    while time.perf_counter() < deadline:
        order = (torch.randperm(c // m, generator=generator).to(a.device)
                 if c > per_window * m else identity[:c // m])
        for window in order.split(per_window):
            if time.perf_counter() >= deadline:
                break
            slots = (window[:, None] * m + within).reshape(-1)
            perm[slots] = perm[slots][_search_window(a[:, perm[slots]], n, m, deadline)]
        before, kept = kept, _kept(a[:, perm], n, m)
        if c <= per_window * m or kept - before <= MIN_PASS_GAIN * (kept - start):
            break
    return perm if kept > start else identity
