import pytest

from sparse_training.pieces.patterns import Pattern, parse_pattern


@pytest.mark.parametrize(("spec", "expected"), [
    ("unstructured", Pattern(spec="unstructured")),
    ("2:4", Pattern(1, 1, 2, 4, False, "2:4")),
    (" 2:4 ", Pattern(1, 1, 2, 4, False, "2:4")),
    ("3:32", Pattern(1, 1, 3, 32, False, "3:32")),
    ("2:4:2d", Pattern(1, 1, 2, 4, True, "2:4:2d")),
    ("block:4x8", Pattern(4, 8, None, None, False, "block:4x8")),
    ("vector:8", Pattern(8, 1, None, None, False, "vector:8")),
    ("block:2x2+2:4", Pattern(2, 2, 2, 4, False, "block:2x2+2:4")),
    ("vector:4+1:4", Pattern(4, 1, 1, 4, False, "vector:4+1:4")),
])
def test_parse(spec, expected):
    assert parse_pattern(spec) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("2-4", r"unknown pattern '2-4'; did you mean '2:4'\? valid forms"),
    ("block:4", r"unknown pattern 'block:4'; did you mean 'block:4x4'\? valid forms"),
    ("n:m", r"unknown pattern 'n:m'; valid forms"),  # no near miss: no guess
    # near misses name the form they likely meant
    ("2of4", r"unknown pattern '2of4'; did you mean '2:4'\? valid forms"),
    ("2 / 4", r"unknown pattern '2 / 4'; did you mean '2:4'\? valid forms"),
    ("1x4", r"unknown pattern '1x4'; did you mean 'block:1x4'\? valid forms"),
    ("Blocks:32X32", r"unknown pattern 'Blocks:32X32'; did you mean 'block:32x32'\? valid"),
    ("vector-8", r"unknown pattern 'vector-8'; did you mean 'vector:8'\? valid forms"),
    ("heads", r"unknown pattern 'heads'; did you mean 'head'\? valid forms"),
    ("neurons", r"unknown pattern 'neurons'; did you mean 'neuron'\? valid forms"),
    ("5:4", "N must satisfy 1 <= N <= M, got N=5, M=4"),
    ("0:4", "N must satisfy 1 <= N <= M, got N=0, M=4"),
    ("block:0x4", "block dimensions must be >= 1, got 0x4"),
    ("2:8:2d", "transposable N:M supports M <= 5"),
    (24, "pattern must be a string, got the number 24; valid forms: "),
])
def test_parse_errors(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_pattern(spec)


def test_kept_per_group_ramps_to_n():
    p = parse_pattern("2:8")
    assert [p.kept_per_group(s) for s in (0.0, 0.25, 0.5, 0.75, 0.9)] == [8, 6, 4, 2, 2]
    assert p.nm_sparsity == 0.75


def test_shape_error_messages():
    assert parse_pattern("2:4").shape_error(8, 6) == (
        "6 input features are not a multiple of M = 4")
    assert parse_pattern("block:2x2+2:4").shape_error(6, 12) == (
        "12 input features are not a multiple of M x block columns = 8")
    assert parse_pattern("vector:4+1:4").shape_error(6, 8) == (
        "6 rows are not a multiple of the block's 4")
    assert parse_pattern("2:4:2d").shape_error(6, 8) == (
        "6 rows are not a multiple of M = 4 (transposable tiles)")
    assert parse_pattern("unstructured").shape_error(7, 3) is None


@pytest.mark.parametrize("spec", ["block:4x4", "block:16x16", "vector:8", "unstructured"])
@pytest.mark.parametrize("shape", [(6, 8), (3, 64), (10, 30), (1, 1), (17, 5)])
def test_block_patterns_take_any_shape_their_last_blocks_overhanging(spec, shape):
    assert parse_pattern(spec).shape_error(*shape) is None
