"""Permutation sites: where input channels can be permuted without changing the function.

A site is a consumer weight whose input channels (dim 1) are permuted, and every tensor
upstream whose ``dim`` runs over the same channels: the producer's rows and bias and, in
between, per-channel tensors such as BatchNorm's. Anything between producer and consumer
must act on each channel alone (activations, dropout, pooling), so that permuting the
producer's outputs permutes the consumer's inputs the same way. :func:`find_sites`
recognizes them by module type and layout, trusting that an ``nn.Sequential`` runs its
children in order and a BERT-family layer computes what HF's does; other models can list
their own :class:`Site` objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.utils import parametrize

ELEMENTWISE = (  # act on each entry alone
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Dropout, nn.Identity,
)
CONV_NORMS = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d}
CONV_CHANNELWISE = (  # act on each channel of a (N, C, *spatial) input alone
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
)
NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True)
class Site:
    """One consumer weight and the tensors permuted with its input channels.

    Attributes:
        producer: ``(module, attribute, dim)`` of every tensor whose ``dim`` runs over the
            consumer's input channels: the producer's weight rows and bias, BatchNorm's
            weight, bias, running_mean and running_var.
        consumer: ``(module, "weight")``, permuted along dim 1.
        name: the consumer's qualified name in the model.
        heads: the permutation maps each of ``heads`` equal consecutive blocks of channels
            onto itself (attention heads); 1 for a free permutation.
    """

    producer: list[tuple[nn.Module, str, int]]
    consumer: tuple[nn.Module, str]
    name: str
    heads: int = 1


def _rows(module: nn.Module, attributes: tuple[str, ...] = ("weight", "bias")
          ) -> list[tuple[nn.Module, str, int]]:
    """``(module, attribute, 0)`` for each of ``attributes`` that the module has."""
    return [(module, a, 0) for a in attributes if getattr(module, a, None) is not None]


def _sequential_sites(seq: nn.Sequential, prefix: str) -> list[Site]:
    """Inside one ``nn.Sequential``: Linear -> elementwise modules -> Linear, and
    Conv -> (its BatchNorm, elementwise or per-channel modules) -> Conv of the same type,
    ungrouped (the channels of a Linear's output are its last dim, so pooling and
    BatchNorm would mix them)."""
    children = list(seq.named_children())
    sites = []
    for i, (_, producer) in enumerate(children):
        kind = type(producer)
        if kind is not nn.Linear and (kind not in CONV_NORMS or producer.groups != 1):
            continue
        rows, channels = _rows(producer), producer.weight.shape[0]
        for name, follower in children[i + 1:]:
            if type(follower) is kind:
                if getattr(follower, "groups", 1) == 1 and follower.weight.shape[1] == channels:
                    sites.append(Site(rows, (follower, "weight"), f"{prefix}{name}"))
                break
            if type(follower) is CONV_NORMS.get(kind) and follower.num_features == channels:
                rows = rows + _rows(follower, NORM_TENSORS)
            elif not isinstance(follower, ELEMENTWISE) and not (
                    kind in CONV_NORMS and isinstance(follower, CONV_CHANNELWISE)):
                break
    return sites


def _bert_sites(module: nn.Module, prefix: str) -> list[Site]:
    """Sites of the HF BERT family's (BERT, RoBERTa, ELECTRA, ...) module layout.

    A layer (``intermediate.dense`` -> ``intermediate_act_fn`` -> ``output.dense``), and an
    attention block (``self.value`` -> softmax-weighted sum per head -> ``output.dense``);
    query and key are left alone: their product is not elementwise per channel.
    """
    output = getattr(getattr(module, "output", None), "dense", None)
    if not isinstance(output, nn.Linear):
        return []
    inter = getattr(module, "intermediate", None)
    if isinstance(getattr(inter, "dense", None), nn.Linear) and hasattr(
            inter, "intermediate_act_fn"):
        return [Site(_rows(inter.dense), (output, "weight"), f"{prefix}output.dense")]
    attention = getattr(module, "self", None)
    heads = getattr(attention, "num_attention_heads", None)
    value = getattr(attention, "value", None)
    if isinstance(value, nn.Linear) and isinstance(heads, int) and heads >= 1 and (
            value.out_features % heads == 0):
        return [Site(_rows(value), (output, "weight"), f"{prefix}output.dense", heads)]
    return []


def _plain(site: Site, shared: set[int]) -> bool:
    """No permuted tensor is parametrized or shared with another module."""
    for module, attr, *_ in [*site.producer, site.consumer]:
        if parametrize.is_parametrized(module, attr) or id(getattr(module, attr)) in shared:
            return False
    return True


def check_model(model: nn.Module, function: str) -> None:
    """Raise TypeError, naming ``function`` and the value, unless ``model`` is an
    ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function} takes a model (a torch.nn.Module), got {model!r} of type "
                        f"{type(model).__name__}")


def find_sites(model: nn.Module) -> list[Site]:
    """Every permutation site of ``model``, in module order.

    Recognized: inside an ``nn.Sequential``, Linear -> elementwise modules -> Linear and
    Conv -> (BatchNorm, elementwise, pooling) -> Conv (same type, ``groups=1``); in the HF
    BERT family, each layer's MLP (``intermediate.dense`` -> ``output.dense``) and each
    attention's value -> ``output.dense``, permuted within each head. Sites whose tensors
    are parametrized or tied to another module are skipped.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> [site.name for site in find_sites(mlp)]
        ['2']
    """
    check_model(model, "find_sites")
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    shared = {key for key, count in seen.items() if count > 1}
    sites = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Sequential):
            sites += _sequential_sites(module, prefix)
        sites += _bert_sites(module, prefix)
    return [site for site in sites if _plain(site, shared)]
