"""Selection of real models' tensors by SparsityEngine: HF Conv1D stored (in, out),
ConvTranspose (in, out, k, k), tied embeddings, lazy layers, heads and weights that blocks of
the pattern overhang. Every case is an error naming the value and the fix, raised before any
weight or mask changes, or is handled as docs/selection.md and docs/patterns.md say (checked
by hand-made counts)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine


def _conv1d(nx: int, nf: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(nf, nx)  # weight (nx, nf): input features first


class TiedHead(nn.Module):
    """An LM whose head shares the embedding's tensor (one Parameter, two names)."""

    def __init__(self, width: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


class CrossLayoutTie(nn.Module):
    """A Conv1D (in, out) and a Linear (out, in) sharing one square tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = _conv1d(16, 16)
        self.back = nn.Linear(16, 16)
        self.back.weight = self.proj.weight


class StackedExperts(nn.Module):
    """A MoE block's experts as one parameter, ``(experts, out, in)`` as transformers 5's
    ``MixtralExperts`` holds them, beside a Conv2d, whose 4-D kernel still takes N:M."""

    def __init__(self, experts: int = 8) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, 16, 8))
        self.conv = nn.Conv2d(8, 8, 3)


EXPERTS_TYPES = [StackedExperts, "Conv2d"]
NO_INPUT_DIM = ("a 3-D weight ({}) of StackedExperts, not a convolution, names no input "
                "dimension to group along (stacked experts may be (experts, out, in) or "
                "(experts, in, out)); give it 'unstructured' (an override) or deny it")


def _seq(*shapes: tuple[int, int]) -> nn.Module:
    """Linear layers of the given (out, in) weight shapes."""
    return nn.Sequential(*(nn.Linear(inp, out) for out, inp in shapes))


CONV1D_TYPES = ["Linear", "transformers.pytorch_utils.Conv1D"]

SELECTION_ERRORS = [  # (model, settings, message)
    (TiedHead, dict(overrides={"embed": {"sparsity": 0.0}, "lm_head": {"pattern": "1:4"}}),
     r"tied tensor \(one Parameter, one mask\) gets two settings: 'embed.weight' takes "
     r"overrides\['embed'\]: pattern '2:4', sparsity 0.0; 'lm_head.weight' takes "
     r"overrides\['lm_head'\]: pattern '1:4', sparsity 0.75. Give its names one setting: an "
     r"override whose regex matches every name \(e.g. 'embed.weight\|lm_head.weight'\)"),
    (TiedHead, dict(overrides={"lm_head": {"pattern": "1:4"}}),
     r"'embed.weight' takes the model-wide setting: pattern '2:4', sparsity 0.5; "
     r"'lm_head.weight' takes overrides\['lm_head'\]: pattern '1:4'"),
    (TiedHead, dict(pattern="unstructured", sparsity=0.5, distribution="erk",
                    overrides={"lm_head": {"sparsity": 0.5}}),
     r"'embed.weight' takes the model-wide setting: pattern 'unstructured', sparsity erk"),
    (TiedHead, dict(overrides={"embed": {"sparsity": 0.5}, "mix": {"pattern": "1:4"}},
                    deny=["lm_head"]),
     r"overrides regex 'embed' matches only tensors that earlier rules skip: "
     r"'embed.weight' \(deny 'lm_head' \(tied: lm_head.weight\)\)"),
    (lambda: nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 8)),
     dict(overrides={"^0": {"pattern": "1:4"}}),
     r"overrides regex '\^0' matches only tensors that earlier rules skip: '0.weight' \(type "
     r"Embedding not in layer_types\). Widen layer_types, narrow deny/allow, or remove"),
    (lambda: _seq((8, 16), (8, 8)), dict(allow=["^0"], overrides={"^1": {"pattern": "1:4"}}),
     r"overrides regex '\^1' matches only .* '1.weight' \(matches no allow regex\)"),
    (lambda: _seq((8, 16), (8, 8)),
     dict(overrides={"weight": {"pattern": "1:4"}, "^1": {"pattern": "2:4"}}),
     r"overrides regex '\^1' never applies: every eligible tensor it matches \(e.g. "
     r"'1.weight'\) takes the earlier override 'weight' \(the first matching regex wins\); "
     r"put '\^1' first or narrow 'weight'"),
    (lambda: nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 8)), dict(allow=["^0"]),
     r"allow regex '\^0' matches only tensors that earlier rules skip: '0.weight' \(type "
     r"Embedding not in layer_types\)"),
    (lambda: _seq((8, 16), (8, 8)), dict(allow=["^1"], deny=["^1"]),
     r"allow regex '\^1' matches only tensors that earlier rules skip: '1.weight' \(deny "
     r"'\^1'\)"),
    (lambda: nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 8)), dict(),
     r"parameter '0.weight' of LazyLinear is not initialized yet \(a lazy module\): .*run "
     r"one forward pass"),
    (lambda: _seq((64, 64), (10, 30)), dict(pattern="block:16x16", sparsity=0.9,
                                            overrides={r"^1\.": {"sparsity": 0.9}}),
     r"tensor '1.weight' \(shape \(10, 30\)\) was asked for by name but pattern "
     r"'block:16x16' at sparsity 0.9 keeps none of its 2 blocks \(round\(0.9 x 2\) = 2 "
     r"pruned\): the tensor would be all zeros; lower its sparsity"),
    (CrossLayoutTie, dict(layer_types=CONV1D_TYPES),
     r"tensor 'proj.weight' is tied across layouts: 'proj.weight' \(Conv1D, input dim 0\), "
     r"'back.weight' \(Linear, input dim 1\); pattern '2:4' groups along one input dimension"),
    (lambda: nn.Sequential(_conv1d(6, 8)), dict(layer_types=CONV1D_TYPES, allow=["0"]),
     r"tensor '0.weight' \(shape \(6, 8\)\) was asked for by name but cannot take pattern "
     r"'2:4': 6 input features are not a multiple of M = 4"),
    (lambda: nn.Sequential(nn.ConvTranspose2d(6, 8, 3)), dict(layer_types=["ConvTranspose2d"],
                                                            allow=["0"]),
     r"'0.weight' \(shape \(6, 8, 3, 3\)\) .* cannot take pattern '2:4': 6 input features"),
    (StackedExperts, dict(pattern="block:4x4", sparsity=0.5, layer_types=EXPERTS_TYPES,
                          allow=["up"]),
     r"^tensor 'up' \(shape \(8, 16, 8\)\) was asked for by name but cannot take pattern "
     r"'block:4x4': " + re.escape(NO_INPUT_DIM.format("8x16x8")) + "$"),
]


@pytest.mark.parametrize(("make_model", "settings", "message"), SELECTION_ERRORS,
                         ids=[f"{i}-{m[:30]}" for i, (_, _, m) in enumerate(SELECTION_ERRORS)])
def test_selection_errors_come_before_any_change(make_model, settings, message):
    model = make_model()
    lazy = any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())
    before = None if lazy else {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        SparsityEngine(model, SparsityConfig(**settings))
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
    if before is not None:
        assert set(before) == set(model.state_dict())
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _groups(mask: torch.Tensor, reduction_dim: int, m: int) -> torch.Tensor:
    """Kept entries in each group of m consecutive entries along the reduction dimension."""
    return mask.movedim(reduction_dim, -1).reshape(-1, m).sum(-1)


def _block_counts(mask: torch.Tensor, block: tuple[int, int]) -> list[tuple[int, int]]:
    """(kept entries, entries) of every block of a 2-D mask, the last ones clipped."""
    (r, c), (rows, cols) = block, mask.shape
    return [(int(mask[i:i + r, j:j + c].sum()), mask[i:i + r, j:j + c].numel())
            for i in range(0, rows, r) for j in range(0, cols, c)]


def _kept_blocks(mask: torch.Tensor, block: tuple[int, int]) -> int:
    counts = _block_counts(mask, block)
    assert all(kept in (0, size) for kept, size in counts)  # whole (clipped) blocks
    return sum(kept > 0 for kept, _ in counts)


def _plans(model: nn.Module, **settings):
    engine = SparsityEngine(model, SparsityConfig(**settings))
    engine.prune()
    return {p.name: p for p in engine.plans}, {s.name: s for s in engine.slots}


def _conv1d_groups_along_inputs(model, plans, slots):
    (slot,) = slots.values()
    assert slot.param.shape == (64, 24)  # (in, out)
    assert (_groups(slot.mask, 0, 4) == 2).all() and _groups(slot.mask, 1, 4).unique().numel() > 1


def _conv_transpose_groups_along_inputs(model, plans, slots):
    (slot,) = slots.values()
    assert (_groups(slot.mask, 0, 4) == 2).all()  # (in, out, kh, kw): inputs first


def _linear_overhang(rows_kept: int):
    def check(model, plans, slots):
        ((name, slot),) = slots.items()
        assert _kept_blocks(slot.mask, (16, 16)) == rows_kept, name
        assert not slot.param[~slot.mask].any()
    return check


def _head_skipped(message):
    def check(model, plans, slots):
        assert not slots and plans["0.weight"].reason.startswith(message)
    return check


def _dense_keeps_nothing(model, plans, slots):
    assert set(slots) == {"0.weight"}
    assert plans["1.weight"].reason == ("pattern 'block:16x16' at sparsity 0.95 keeps none of "
                                        "its 6 blocks (round(0.95 x 6) = 6 pruned): the "
                                        "tensor would be all zeros")
    assert model[1].weight.all()


def _tied_one_row(reason):
    def check(model, plans, slots):
        assert plans["embed.weight"].reason == reason and plans["embed.weight"].selected
        assert (_groups(slots["embed.weight"].mask, 1, 4) == 1).all()
    return check


def _cross_layout_unstructured(model, plans, slots):
    assert int(slots["proj.weight"].mask.sum()) == 128  # 256 - round(0.5 x 256)


def _denied_by_type_is_fine(model, plans, slots):
    assert plans["0.weight"].reason == "type Embedding not in layer_types"
    assert set(slots) == {"1.weight"}


def _global_overhang(model, plans, slots):
    assert plans["0.weight"].sparsity is None
    kept = sum(_kept_blocks(s.mask, (16, 16)) for s in slots.values())
    assert kept == 10 - 5  # 3 x 2 blocks of 40x30, 1 x 4 of 10x64: round(0.5 x 10) pruned


def _experts_dense(shape: str):
    def check(model, plans, slots):
        assert plans["up"].reason == f"shape cannot take '2:4': {NO_INPUT_DIM.format(shape)}"
        assert set(slots) == {"conv.weight"} and (_groups(slots["conv.weight"].mask, 1, 4)
                                                  == 2).all()
    return check


def _experts_unstructured(model, plans, slots):
    assert int(slots["up"].mask.sum()) == 8 * 16 * 8 // 2


def _lstm_and_attention_along_inputs(model, plans, slots):
    assert len(slots) == 5
    for slot in slots.values():  # (4H, in), (4H, proj), (proj, H), (3E, E), (E, E)
        assert (_groups(slot.mask, 1, 4) == 2).all(), slot.name


SELECTION_HANDLED = [  # (model, settings, check of (model, plans by name, slots by name))
    (lambda: nn.Sequential(_conv1d(64, 24)), dict(layer_types=CONV1D_TYPES),
     _conv1d_groups_along_inputs),
    (lambda: nn.Sequential(nn.ConvTranspose2d(8, 6, 3)), dict(layer_types=["ConvTranspose2d"]),
     _conv_transpose_groups_along_inputs),
    (lambda: _seq((3, 64)), dict(pattern="block:16x16", sparsity=0.5, allow=["0"]),
     _linear_overhang(2)),  # 1 x 4 blocks of 3 rows
    (lambda: _seq((10, 30)), dict(pattern="block:16x16", sparsity=0.5, allow=["0"]),
     _linear_overhang(1)),  # 1 x 2 blocks, 10x16 and 10x14
    (lambda: _seq((40, 70)), dict(pattern="block:16x16", sparsity=0.75),
     _linear_overhang(4)),  # 3 x 5 blocks: 15 - round(11.25)
    (lambda: _seq((3, 64)), dict(pattern="block:16x16", sparsity=0.5),
     _head_skipped("3 rows < the block's 16: a task head? name it in allow or overrides")),
    (lambda: nn.Sequential(_conv1d(64, 2)), dict(layer_types=CONV1D_TYPES),
     _head_skipped("2 outputs < M = 4: a task head?")),  # (64, 2): 2 outputs, not 64
    (lambda: _seq((64, 64), (40, 30)), dict(pattern="block:16x16", sparsity=0.95),
     _dense_keeps_nothing),
    (TiedHead, dict(pattern="1:4", overrides={"embed": {"sparsity": 0.75},
                                              "lm_head": {"sparsity": 0.75}}),
     _tied_one_row("override 'embed' (tied: lm_head.weight)")),
    (TiedHead, dict(pattern="2:4", overrides={"lm_head": {"pattern": "1:4"}, "embed":
                                              {"pattern": "1:4"}}, deny=["mix"]),
     _tied_one_row("override 'lm_head' (tied: lm_head.weight)")),
    (CrossLayoutTie, dict(pattern="unstructured", sparsity=0.5, layer_types=CONV1D_TYPES),
     _cross_layout_unstructured),
    (lambda: nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 8)), dict(deny=["^0"]),
     _denied_by_type_is_fine),
    (lambda: _seq((40, 30), (10, 64)), dict(pattern="block:16x16", sparsity=0.5,
                                            distribution="global", allow=["."]),
     _global_overhang),
    (lambda: nn.ModuleList([nn.LSTM(8, 8, proj_size=4), nn.MultiheadAttention(8, 2)]), dict(),
     _lstm_and_attention_along_inputs),
    (StackedExperts, dict(layer_types=EXPERTS_TYPES), _experts_dense("8x16x8")),
    (lambda: StackedExperts(2), dict(layer_types=EXPERTS_TYPES),  # not "2 outputs < M"
     _experts_dense("2x16x8")),
    (StackedExperts, dict(pattern="unstructured", sparsity=0.5, layer_types=EXPERTS_TYPES),
     _experts_unstructured),
]


@pytest.mark.parametrize(("make_model", "settings", "check"), SELECTION_HANDLED,
                         ids=[f"{i}-{c.__qualname__.split('.')[0]}"
                              for i, (_, _, c) in enumerate(SELECTION_HANDLED)])
def test_selection_handled_as_documented(make_model, settings, check):
    torch.manual_seed(0)
    model = make_model()
    check(model, *_plans(model, **settings))


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    assert (len(SELECTION_ERRORS), len(SELECTION_HANDLED)) == (15, 17)


@pytest.mark.parametrize("experts", [2, 8])
def test_mixtral_experts_stay_dense_under_nm_with_the_reason(experts):
    """transformers 5's MixtralExperts: gate_up_proj (experts, 2 x ffn, hidden) and
    down_proj (experts, hidden, ffn); 2 experts are no "task head", 8 no N:M along dim 1."""
    transformers = pytest.importorskip("transformers")
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, vocab_size=64))
    kind = type(model.model.layers[0].mlp.experts)
    plans, slots = _plans(model, layer_types=["Linear", kind])
    for name, shape in (("gate_up_proj", f"{experts}x128x32"), ("down_proj", f"{experts}x32x64")):
        reason = plans[f"model.layers.0.mlp.experts.{name}"].reason
        assert reason.startswith(f"shape cannot take '2:4': a 3-D weight ({shape}) of "
                                 f"{kind.__name__}, not a convolution"), reason
    assert "model.layers.0.self_attn.q_proj.weight" in slots


class ConvLike(nn.Module):
    """A user's convolution through ``F.conv2d`` stating ``in_channels`` and ``kernel_size``
    as torch's and torchvision's do: its 4-D weight groups along its input channels."""

    def __init__(self) -> None:
        super().__init__()
        self.in_channels, self.kernel_size = 16, (3, 3)
        self.weight = nn.Parameter(torch.randn(8, 16, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, self.weight, padding=1)


def test_a_conv_like_module_of_the_users_takes_nm_along_its_input_channels():
    plans, slots = _plans(nn.Sequential(ConvLike()), layer_types=[ConvLike])
    assert "0.weight" in slots, plans["0.weight"].reason
    assert (_groups(slots["0.weight"].mask, 1, 4) == 2).all()  # 2 of each 4 input channels
