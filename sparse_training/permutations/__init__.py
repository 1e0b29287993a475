"""Channel permutations for N:M sparsity (Pool & Yu, "Channel Permutations for N:M
Sparsity", NeurIPS 2021), as in NVIDIA ASP.

Before N:M magnitude pruning, :func:`permute_channels` regroups each consumer weight's
input channels so that more magnitude survives, and permutes the producer's outputs alike,
so that the dense network computes the same function:

* :mod:`.search`: :func:`kept_magnitude` and :func:`search_permutation` (greedy swaps);
* :mod:`.sites`: :class:`Site` and :func:`find_sites` (Sequential chains, BERT layers).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.engine.slots import MASK_SUFFIX
from sparse_training.permutations.search import (
    check_seconds,
    finite_problem,
    kept_magnitude,
    search_permutation,
)
from sparse_training.permutations.sites import Site, check_model, find_sites
from sparse_training.pieces.patterns import parse_pattern

__all__ = ["Site", "find_sites", "kept_magnitude", "permute_channels", "search_permutation"]


def _parse_nm(pattern: str) -> tuple[int, int]:
    """``(N, M)`` of a plain ``"N:M"`` pattern string."""
    problem = f"channel permutations need an 'N:M' pattern (e.g. '2:4'), got {pattern!r}"
    try:
        parsed = parse_pattern(pattern)
    except ValueError:
        raise ValueError(problem) from None
    if not parsed.is_nm or parsed.transposable or (parsed.block_rows, parsed.block_cols) != (1, 1):
        raise ValueError(problem)
    return parsed.n, parsed.m


def _tensors(site: Site) -> list[tuple[nn.Module, str, int]]:
    """``(module, attribute, dim)`` of every tensor the site permutes, consumer first."""
    return [(*site.consumer, 1), *site.producer]


def _check_site(site: Site, m: int, optimizer: Optimizer | None) -> None:
    """Raise ValueError if the site's tensors cannot all take a permutation of its channels."""
    weight = getattr(*site.consumer, None)
    if not isinstance(weight, Tensor) or weight.dim() < 2:
        raise ValueError(f"site {site.name!r}: the consumer {site.consumer[1]!r} is not a "
                         f"weight with input channels along dim 1")
    if problem := finite_problem(weight):
        raise ValueError(f"site {site.name!r}: the consumer's {problem}")
    channels = weight.shape[1]
    if site.heads < 1 or channels % site.heads:
        raise ValueError(f"site {site.name!r}: {channels} input channels do not split into "
                         f"{site.heads} heads")
    if channels // site.heads % m:
        per = "" if site.heads == 1 else f" ({channels // site.heads} per head)"
        raise ValueError(f"site {site.name!r}: {channels} input channels{per} are not a "
                         f"multiple of M = {m}")
    for module, attr, dim in _tensors(site):
        tensor = getattr(module, attr, None)
        if not isinstance(tensor, Tensor) or tensor.dim() <= dim or tensor.shape[dim] != channels:
            raise ValueError(f"site {site.name!r}: {type(module).__name__}.{attr} is not a "
                             f"tensor with {channels} entries along dim {dim}")
        if attr + MASK_SUFFIX in module._buffers:
            raise ValueError(f"site {site.name!r}: {type(module).__name__}.{attr} already has "
                             f"a sparsity mask; permute channels before pruning")
        state = optimizer.state.get(tensor, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != tensor.shape:
                raise ValueError(f"site {site.name!r}: optimizer state {key!r} of "
                                 f"{type(module).__name__}.{attr} has shape "
                                 f"{tuple(value.shape)}, not the parameter's {tuple(tensor.shape)}")


def _search(weight: Tensor, n: int, m: int, heads: int, seed: int, max_seconds: float) -> Tensor:
    """A permutation of ``weight``'s input channels that maps each head onto itself, within
    ``max_seconds`` (inf: converge) shared evenly by the heads still to search."""
    size = weight.shape[1] // heads
    deadline = time.perf_counter() + max_seconds
    parts = []
    for h in range(heads):
        budget = max(0.0, (deadline - time.perf_counter()) / (heads - h))
        perm = search_permutation(weight[:, h * size:(h + 1) * size], n, m, seed=seed,
                                  max_seconds=budget)
        parts.append(perm + h * size)
    return torch.cat(parts)


@torch.no_grad()
def _apply(site: Site, perm: Tensor, optimizer: Optimizer | None) -> None:
    """Permute the site's tensors (and their optimizer state) along their channel dim."""
    for module, attr, dim in _tensors(site):
        tensor = getattr(module, attr)
        index = perm.to(tensor.device)
        state = optimizer.state.get(tensor, {}) if optimizer is not None else {}
        for value in [tensor, *state.values()]:
            if isinstance(value, Tensor) and value.shape == tensor.shape:
                value.copy_(value.index_select(dim, index))


def permute_channels(
    model: nn.Module, pattern: str = "2:4", *, sites: list[Site] | None = None,
    seed: int = 0, max_seconds_per_site: float | None = 10.0,
    optimizer: Optimizer | None = None,
) -> list[dict]:
    """Permute input channels in place so that N:M pruning keeps more magnitude, without
    changing what the dense model computes.

    For each site, :func:`search_permutation` finds ``perm`` for the consumer weight; its
    input channels become ``weight[:, perm]`` and every producer tensor is permuted alike
    along its dim, so the consumer reads the same values. Run it on the trained dense
    model, before pruning (the engine's masks would no longer match) and before the
    optimizer has state, or pass the ``optimizer``: its per-parameter state shaped like
    a permuted parameter (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) is permuted too.

    Args:
        model: the model; its sites are found with :func:`find_sites` unless given.
        pattern: the N:M pattern that pruning will use, e.g. ``"2:4"``.
        sites: the sites to permute (default: ``find_sites(model)``).
        seed: passed to :func:`search_permutation`.
        max_seconds_per_site: search budget of each site (None: converge; 0: no search).
        optimizer: an optimizer whose state follows the permuted parameters.

    Returns:
        One row per site: ``{"site", "kept_before", "kept_after", "gain", "seconds"}``,
        the consumer's kept magnitude (:func:`kept_magnitude`) before and after, and
        ``gain = kept_after / kept_before - 1``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: for a pattern that is not ``"N:M"``, a negative or NaN
            ``max_seconds_per_site``, or a site whose input channels
            (per head) are not a multiple of M, whose consumer weight holds NaN or inf,
            whose tensors do not match its channels,
            that already has a mask, or whose optimizer state is not parameter-shaped;
            all checked before anything changes.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        >>> [row["site"] for row in permute_channels(mlp, "2:4")]
        ['2']
    """
    check_model(model, "permute_channels")
    n, m = _parse_nm(pattern)
    budget = check_seconds(max_seconds_per_site, "max_seconds_per_site")
    sites = find_sites(model) if sites is None else list(sites)
    for site in sites:
        _check_site(site, m, optimizer)
    rows = []
    for site in sites:
        start = time.perf_counter()
        weight = getattr(*site.consumer)
        before = kept_magnitude(weight, n, m)
        _apply(site, _search(weight, n, m, site.heads, seed, budget), optimizer)
        after = kept_magnitude(weight, n, m)
        rows.append({"site": site.name, "kept_before": before, "kept_after": after,
                     "gain": after / before - 1 if before > 0 else 0.0,
                     "seconds": time.perf_counter() - start})
    return rows
