"""A Linear layer that is physically smaller: :class:`SlimLinear`, the compressed form of the
``"head"`` and ``"neuron"`` patterns.

Pruning a whole head or FFN neuron removes bands of rows from the projections that compute
it (query, key, value; up, gate) and the matching bands of columns from the projection that
reads it (output; down), :mod:`sparse_training.pieces.units`. Once the pruned units are
fixed, the layers need not hold zeros: a row-sliced layer keeps only the rows of its kept
bands (and their bias) and outputs only those features, and a column-sliced one reads only
the features of its kept bands, so the activations between them are smaller too, and every
product is a smaller dense one (cuBLAS at full efficiency)::

    rows:     y = x W[K]^T + b[K]        (W[K]: the kept rows, shape (|K|, in))
    columns:  y = x_K W[:, K]^T + b      (x_K: the kept features the row layers output)

Attention modules that reshape with ``-1`` heads (BERT, ViT, Llama, BART)
compute with the kept heads as they are; the FFN's activation is elementwise.

The ``state_dict`` is ``nn.Linear``'s in the original shape (zeros at the removed bands), so
a checkpoint loads strictly into the dense model, which computes the same function. Loading
the dense form back keeps the bands that hold a nonzero (exactly the layer's count of them;
fewer are filled with empty bands, as the optimizer's checkpoint may keep a band at zero).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.engine.protocol import CompressedLayer, LayerForm
from sparse_training.engine.sharding import copy_whole, full, gather_rows, shard_rows
from sparse_training.engine.slots import state_tensors
from sparse_training.layers.blocks import transfer
from sparse_training.layers.storage import CompressedSlot
from sparse_training.pieces.patterns import parse_pattern
from sparse_training.pieces.units import COLUMNS, ROWS

AXES = {ROWS: "rows", COLUMNS: "columns"}


class SlimLinear(CompressedLayer):
    """``y = x W^T + b`` for a Linear of ``out_features x in_features`` of which only the kept
    bands of ``band`` rows (``axis=ROWS``) or columns (``axis=COLUMNS``) exist (module doc).

    Args:
        in_features, out_features: the dense layer's.
        axis: :data:`~sparse_training.pieces.units.ROWS` (outputs are removed) or
            :data:`~sparse_training.pieces.units.COLUMNS` (inputs are removed).
        band: rows (or columns) of one band (one head's, or one neuron's: 1).
        band_mask: bool ``(bands,)``, True where a band is kept (at least one).
    """

    mask_buffer = "band_mask"

    def __init__(self, in_features: int, out_features: int, axis: int, band: int,
                 band_mask: Tensor, bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if axis not in AXES:
            raise ValueError(f"axis must be ROWS ({ROWS}) or COLUMNS ({COLUMNS}), got {axis!r}")
        width = out_features if axis == ROWS else in_features
        if band < 1 or width % band:
            raise ValueError(f"bands of {band} do not tile the {width} {AXES[axis]} of a "
                             f"{out_features}x{in_features} Linear")
        if band_mask.dtype != torch.bool or tuple(band_mask.shape) != (width // band,):
            raise ValueError(f"band_mask must be bool of shape ({width // band},), got "
                             f"{band_mask.dtype} {tuple(band_mask.shape)}")
        kept = int(band_mask.sum()) * band
        if kept == 0:
            raise ValueError("band_mask keeps no band; keep at least one")
        super().__init__()
        self.in_features, self.out_features, self.axis, self.band = (
            in_features, out_features, axis, band)
        shape = (kept, in_features) if axis == ROWS else (out_features, kept)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(kept if axis == ROWS else out_features,
                                              device=device, dtype=dtype)) if bias else None)
        self.register_buffer("band_mask", band_mask.to(device=self.weight.device, copy=True),
                             persistent=False)
        with torch.no_grad():
            bound = 1.0 / in_features ** 0.5
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_dense(cls, linear: nn.Linear, axis: int, band: int,
                   band_mask: Tensor) -> SlimLinear:
        """The kept bands of ``linear`` (its weight, bias and ``requires_grad``)."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, axis, band, band_mask,
                    bias=linear.bias is not None, device=weight.device, dtype=weight.dtype)
        index = layer.kept_index
        with torch.no_grad():
            kept = weight.index_select(axis, index)
            bias = None if linear.bias is None else (
                linear.bias.index_select(0, index) if axis == ROWS else linear.bias)
        transfer(layer.weight, kept, weight.requires_grad, layer.bias, bias)
        if bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    @property
    def kept_index(self) -> Tensor:
        """The dense indices along :attr:`axis` that the layer keeps, ascending."""
        return self.band_mask.repeat_interleave(self.band).nonzero().flatten()

    @property
    def pattern(self) -> str:
        """The block pattern of one band in the dense weight (``"block:64x768"``)."""
        rows, cols = ((self.band, self.in_features) if self.axis == ROWS
                      else (self.out_features, self.band))
        return f"block:{rows}x{cols}"

    @property
    def sparsity(self) -> float:
        """Fraction of the dense weight's entries removed: the removed bands'."""
        return 1.0 - float(self.band_mask.float().mean())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> Tensor:
        """The dense weight, zeros at the removed bands (differentiable in ``weight``; the
        whole of it where FSDP2 shards it: a collective)."""
        weight = full(self.weight)
        dense = weight.new_zeros(self.out_features, self.in_features)
        return dense.index_copy(self.axis, self.kept_index, weight)

    def dense_bias(self) -> Tensor | None:
        """The dense bias, zeros at removed outputs, or None."""
        if self.bias is None:
            return None
        bias = full(self.bias)
        if self.axis == COLUMNS:
            return bias
        return bias.new_zeros(self.out_features).index_copy(0, self.kept_index, bias)

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` of the dense shape computing the same function (zeros at the
        removed bands), same device, dtype and ``requires_grad``."""
        linear = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features,
                                    bias=self.bias is not None, device=self.weight.device,
                                    dtype=self.weight.dtype)
        transfer(linear.weight, self.dense_weight().detach(), self.weight.requires_grad,
                 linear.bias, self.dense_bias())
        return linear

    def slot(self, name: str) -> SlimSlot:
        return SlimSlot(name, self)

    def band_sums(self, per_entry: Tensor) -> Tensor:
        """Float32 sums of a dense-shaped ``per_entry`` over each band: ``(bands,)``."""
        along = per_entry.float() if self.axis == ROWS else per_entry.float().T
        return along.reshape(self.band_mask.numel(), -1).sum(1)

    @torch.no_grad()
    def bands_held(self, dense: Tensor) -> Tensor:
        """Which bands of a dense ``weight`` (and, row-sliced, ``bias``) hold a nonzero."""
        return self.band_sums(dense != 0) > 0

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """``nn.Linear``'s ``weight`` and ``bias`` in the dense shape (module doc)."""
        weight, bias = self.dense_weight(), self.dense_bias()
        destination[prefix + "weight"] = weight if keep_vars else weight.detach()
        if bias is not None:
            destination[prefix + "bias"] = bias if keep_vars else bias.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Load the dense form: the bands holding a nonzero become the kept ones (module
        doc), checked before anything is copied."""
        weight, bias = state_dict.get(prefix + "weight"), state_dict.get(prefix + "bias")
        dense = (self.out_features, self.in_features)
        if weight is None:  # (strict=False) the bias alone loads beside the weight kept
            missing_keys.append(prefix + "weight")
            if bias is None:
                return
            weight = self.dense_weight().detach()
        # set_model_state_dict(full_state_dict=True) hands each rank the dense tensors
        # sharded as the parameters are: gathered (a collective; every rank loads)
        weight, bias = full(weight), None if bias is None else full(bias)
        if tuple(weight.shape) != dense:
            error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                              f"{tuple(weight.shape)}, the layer's dense shape is {dense}")
            return
        if (self.bias is None) != (bias is None):
            (missing_keys if bias is None else unexpected_keys).append(prefix + "bias")
            return
        # a meta layer given the loaded tensors (assign=True) makes its band mask, which is
        # not in the state dict, from them, on their device
        assign = local_metadata.get("assign_to_params_buffers", False)
        mask_device = weight.device if assign and self.band_mask.is_meta else (
            self.band_mask.device)
        held = self.bands_held(weight.to(mask_device))
        by_weight = int(held.sum())
        if self.axis == ROWS and bias is not None:
            held |= (bias.to(held.device).reshape(-1, self.band) != 0).any(1)
        count = self.weight.shape[self.axis] // self.band  # kept bands (no sync, any device)
        if int(held.sum()) > count:
            loaded = "weight is" if by_weight > count else "weight and bias are"
            error_msgs.append(
                f"{prefix.rstrip('.') or 'SlimLinear'}: the loaded {loaded} nonzero in "
                f"{int(held.sum())} bands of {self.band} {AXES[self.axis]}, the layer keeps "
                f"{count} (a checkpoint of another sparsity, or of a dense run; densify the "
                f"model to load it)")
            return
        free = (~held).nonzero().flatten()[: count - int(held.sum())]  # empty bands to fill
        if self.band_mask.device != mask_device:
            self.band_mask = torch.empty_like(self.band_mask, device=mask_device)
        self.band_mask.copy_(held.index_fill(0, free, True))
        index = self.kept_index
        kept = {"weight": weight.index_select(self.axis, index.to(weight.device))}
        if bias is not None:
            kept["bias"] = bias.index_select(0, index.to(bias.device)) if self.axis == ROWS else bias
        with torch.no_grad():
            for name, value in kept.items():
                param = getattr(self, name)
                if assign:  # as nn.Linear's assign=True: the loaded tensors become the params
                    setattr(self, name, nn.Parameter(value, param.requires_grad))
                else:
                    copy_whole(param, value.to(param.device, param.dtype))

    def extra_repr(self) -> str:
        kept = int(self.band_mask.sum())
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{AXES[self.axis]}: {kept} of {self.band_mask.numel()} bands of {self.band}, "
                f"bias={self.bias is not None}")


class SlimSlot(CompressedSlot):
    """A :class:`SlimLinear`: its mask is the band grid (``(bands, 1)`` for row bands,
    ``(1, bands)`` for column bands: one entry per block of its block pattern), fixed from
    the first step; the engine moves bands only to restore a checkpoint's."""

    movable = False  # the units of a structured layer are fixed
    enforced = False  # only the kept bands exist: nothing to mask
    records_gradient = False
    grid_pattern = parse_pattern("unstructured")
    mask_key = "band_mask"
    unit = "bands"

    @property
    def mask(self) -> Tensor:
        mask = self.layer.band_mask
        return mask.view(-1, 1) if self.layer.axis == ROWS else mask.view(1, -1)

    @property
    def form(self) -> LayerForm:
        return LayerForm(self.layer.pattern, tuple(self.mask.shape),
                         int(self.layer.band_mask.sum()))

    @property
    def dense_gradient(self) -> Tensor | None:
        return None

    @property
    def gradient_ready(self) -> bool:
        return self.param.grad is not None

    def forward_weight(self) -> Tensor:
        return self.layer.dense_weight()

    def _grid(self, per_band: Tensor) -> Tensor:
        return per_band.view(self.mask.shape)

    def held(self) -> Tensor:
        """Float32 sums of ``|w|`` per band, shaped like the mask, zero where none."""
        return self._grid(self.layer.band_sums(self.layer.dense_weight().detach().abs()))

    def drop_scores(self, scores: Tensor | None = None) -> Tensor:
        if scores is None:
            return self.held()
        dense = torch.zeros(self.dense_shape, dtype=scores.dtype, device=scores.device)
        return self._grid(self.layer.band_sums(
            dense.index_copy(self.layer.axis, self.layer.kept_index, scores)))

    def grow_scores(self, scores: Tensor) -> Tensor:
        return self._grid(self.layer.band_sums(scores.detach().abs()))

    @torch.no_grad()
    def set_mask(self, mask: Tensor, optimizers: Iterable[Optimizer] = (),
                 reset_state: bool = True, gradient: Tensor | None = None,
                 carried: Sequence[Tensor] = ()) -> None:
        """Keep the bands of ``mask`` (the same count): a band kept before keeps its
        weights, gradient, optimizer state and ``carried`` tensors (a row-sliced layer's
        bias with them); a newly kept one starts at zero."""
        layer = self.layer
        new = mask.to(layer.band_mask.device).flatten()
        if torch.equal(new, layer.band_mask):
            return
        if int(new.sum()) != int(layer.band_mask.sum()):
            raise ValueError(f"{self.name}: a mask of {int(new.sum())} bands for a layer of "
                             f"{int(layer.band_mask.sum())}")
        old_position = torch.full((new.numel(),), -1, dtype=torch.long, device=new.device)
        old_kept = layer.band_mask.nonzero().flatten()
        old_position[old_kept] = torch.arange(old_kept.numel(), device=new.device)
        sources = old_position[new.nonzero().flatten()]  # per new band: its old slot or -1
        rows = (sources[:, None] * layer.band + torch.arange(layer.band, device=new.device)
                ).flatten()
        moved = _with_state(self.param, optimizers)
        if layer.bias is not None and layer.axis == ROWS:  # the kept outputs' bias too
            moved += _with_state(layer.bias, optimizers)
        # sharded tensors (FSDP2): each gathered whole, moved alike on every rank, and each
        # rank keeps its slice; the carried tensors hold the local shard's rows
        for tensor in moved:
            copy_whole(tensor, _moved_bands(full(tensor), rows,
                                            layer.axis if tensor.dim() > 1 else 0))
        for value in carried:
            value.copy_(shard_rows(_moved_bands(gather_rows(value, self.param), rows,
                                                layer.axis), self.param))
        layer.band_mask.copy_(new)


def _with_state(param: Tensor, optimizers: Iterable[Optimizer]) -> list[Tensor]:
    """``param``, its gradient where it has one, and its state in ``optimizers``."""
    return [param, *([param.grad] if param.grad is not None else []),
            *(s for o in optimizers for s in state_tensors(o, param))]


def _moved_bands(tensor: Tensor, rows: Tensor, axis: int) -> Tensor:
    """``tensor``'s slices along ``axis`` rearranged to ``rows`` (-1 based: zero)."""
    gathered = tensor.index_select(axis, rows.clamp(min=0))
    shape = [1] * tensor.dim()
    shape[axis] = -1
    return torch.where((rows >= 0).view(shape), gathered, 0)



DENSE_HEAD_COUNTS = "dense_head_counts"  # an attention module's own counts, before shrinking


def sync_head_counts(model: nn.Module) -> None:
    """Make the head counts an attention module's ``forward`` reads match its projections:
    where a module keeps :data:`DENSE_HEAD_COUNTS` (its counts before any head was removed,
    ``{"num_heads": 12}``) and its query/key/value projections are row-sliced
    :class:`SlimLinear` layers, each count is scaled to the kept fraction of their bands
    (OPT's ``num_heads``, GPT-2's ``split_size``); where they are not (swapped back), the
    counts are restored and the record dropped."""
    for module in model.modules():
        counts = getattr(module, DENSE_HEAD_COUNTS, None)
        if counts is None:
            continue
        rows = [c for c in module.children() if isinstance(c, SlimLinear) and c.axis == ROWS]
        if not rows:
            for attr, value in counts.items():
                setattr(module, attr, value)
            delattr(module, DENSE_HEAD_COUNTS)
            continue
        kept, total = int(rows[0].band_mask.sum()), rows[0].band_mask.numel()
        for attr, value in counts.items():
            setattr(module, attr, value * kept // total)
