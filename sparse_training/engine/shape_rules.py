"""Why a selected tensor cannot take its pattern: no known input dimension, its 2-D view's
shape, a task head too small for the pattern, a target that keeps no block, a tie across
layouts (rule 7 of :mod:`sparse_training.engine.selection`)."""

from __future__ import annotations

from torch import nn

from sparse_training.engine.tensors import WeightTensor
from sparse_training.pieces.masks import as_matrix, kept_count, view_shape_problem
from sparse_training.pieces.patterns import Pattern


def groups_along_input(pattern: Pattern) -> bool:
    """Whether ``pattern`` groups a tensor's entries along its input dimension (N:M groups,
    blocks): every pattern but unstructured."""
    return pattern.is_nm or pattern.block_rows * pattern.block_cols > 1


def conv_like(module: nn.Module) -> bool:
    """A convolution: torch's (``nn.Conv*``), or a module stating ``in_channels`` and
    ``kernel_size`` as they do (torchvision's ``DeformConv2d``, a user's layer calling
    ``F.conv2d``): its weight is ``(out, in / groups, *kernel)``."""
    return isinstance(module, nn.modules.conv._ConvNd) or (
        hasattr(module, "in_channels") and hasattr(module, "kernel_size"))


def shape_problem(tensor: WeightTensor, pattern: Pattern) -> str | None:
    """Why ``tensor`` cannot take ``pattern``: no known input dimension (a weight of three
    or more dimensions of a module that is not a convolution, such as stacked MoE experts,
    ``(experts, out, in)`` in transformers' ``MixtralExperts``; :func:`conv_like` names
    one), or its 2-D view's shape."""
    weight = tensor.param
    if groups_along_input(pattern) and weight.dim() > 2 and not all(
            conv_like(module) for module, _ in tensor.owners):
        return (f"a {weight.dim()}-D weight ({'x'.join(map(str, weight.shape))}) of "
                f"{tensor.kind}, not a convolution, names no input dimension to group along "
                f"(stacked experts may be (experts, out, in) or (experts, in, out)); give it "
                f"'unstructured' (an override) or deny it")
    return view_shape_problem(pattern, weight, tensor.input_dim)


def head_problem(tensor: WeightTensor, pattern: Pattern) -> str | None:
    """Why an unnamed tensor looks like a task head too small for the pattern, or None."""
    if pattern.is_nm:
        outputs = tensor.param.shape[1 - tensor.input_dim]
        if outputs < pattern.m:
            return (f"{outputs} outputs < M = {pattern.m}: a task head? name it in allow or "
                    f"overrides to prune it")
        return None
    rows = as_matrix(tensor.param, tensor.input_dim).shape[0]
    if rows < pattern.block_rows:
        return (f"{rows} rows < the block's {pattern.block_rows}: a task head? name it in "
                f"allow or overrides to prune it")
    return None


def empty_problem(pattern: Pattern, target: float | None, blocks: int,
                  unit_kind: str | None = None) -> str | None:
    """Why a selected tensor's final ``target`` keeps none of its ``blocks`` (its units of
    ``unit_kind``, heads or neurons, where given), or None."""
    if pattern.is_nm or target is None:
        return None
    if kept_count(blocks, target) > 0:
        return None
    unit = (f"{unit_kind}s" if unit_kind is not None else "weights"
            if pattern.block_rows * pattern.block_cols == 1 else "blocks")
    # a unit tie's pattern is the block pattern of its share: name the unit the user chose
    label = repr(unit_kind) if unit_kind is not None else repr(pattern.spec)
    return (f"pattern {label} at sparsity {target:g} keeps none of its {blocks} "
            f"{unit} (round({target:g} x {blocks}) = {blocks} pruned): the tensor would be "
            f"all zeros")


def layout_problem(tensor: WeightTensor, pattern: Pattern) -> str | None:
    """Why a tensor tied across layouts cannot take a structured pattern, or None."""
    if len(set(tensor.input_dims)) == 1 or not groups_along_input(pattern):
        return None
    owners = ", ".join(f"{name!r} ({type(module).__name__}, input dim {dim})" for name,
                       (module, _), dim in zip(tensor.names, tensor.owners, tensor.input_dims,
                                               strict=True))
    return (f"tensor {tensor.name!r} is tied across layouts: {owners}; pattern "
            f"{pattern.spec!r} groups along one input dimension: use 'unstructured' for it "
            f"(an override), untie the weights, or deny the tensor")
