"""Schedules and regrowth rules given as pieces: the same run as their flat settings, options
on the piece, a registry of schedule names users extend."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
from conftest import TinyNet, make_loader, make_trainer

from sparse_training import (
    GMP,
    SET,
    SRSTE,
    Constant,
    OneShot,
    RigL,
    SparsityCallback,
    SparsityConfig,
    register_schedule,
)
from sparse_training.pieces.schedules import SCHEDULES, Gradual, parse_schedule

UNSTRUCTURED = dict(pattern="unstructured", sparsity=0.5)


@pytest.mark.parametrize(("pieces", "flat"), [
    (dict(schedule=GMP(start=0.1, end=0.8, frequency=5)),
     dict(schedule="gmp", start=0.1, end=0.8, frequency=5)),
    (dict(schedule=OneShot(start=7)), dict(schedule="oneshot", start=7)),
    (dict(schedule=Constant(), regrow=RigL(fraction=0.4, end=0.9)),
     dict(schedule="constant", regrow="rigl", regrow_fraction=0.4, regrow_end=0.9)),
    (dict(schedule=Constant(frequency=3), regrow=SET(end=20)),
     dict(schedule="constant", frequency=3, regrow="set", regrow_end=20)),
    (dict(pattern="2:4", sparsity=None, regrow=SRSTE(decay=1e-3)),
     dict(pattern="2:4", sparsity=None, regrow="sr-ste", sr_ste_decay=1e-3)),
])
def test_a_piece_is_the_run_its_flat_settings_give(pieces, flat):
    given, written = SparsityConfig(**{**UNSTRUCTURED, **pieces}), SparsityConfig(
        **{**UNSTRUCTURED, **flat})
    assert given.as_dict() == written.as_dict()
    assert given.parsed_schedule == written.parsed_schedule
    assert given.parsed_regrowth == written.parsed_regrowth
    assert given.parsed_refinement == written.parsed_refinement


@pytest.mark.parametrize(("settings", "named"), [
    (dict(schedule=GMP(end=0.5), start=0.1), "start=0.1"),
    (dict(schedule=GMP(end=0.5), frequency=7, end=0.6), "end=0.6, frequency=7"),
    (dict(schedule=Constant(), regrow=RigL(), regrow_fraction=0.2), "regrow_fraction=0.2"),
    (dict(pattern="2:4", sparsity=None, regrow=SRSTE(), sr_ste_decay=0.1), "sr_ste_decay=0.1"),
])
def test_an_option_beside_its_piece_is_refused_naming_it(settings, named):
    with pytest.raises(ValueError, match=rf"carries its options; {named} given beside it"):
        SparsityConfig(**{**UNSTRUCTURED, **settings})


def test_a_pieces_own_checks_come_first():
    with pytest.raises(ValueError, match="start must come before end"):
        GMP(start=10, end=5)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: RigL(fraction=2), r"^RigL.fraction must be a number in \(0, 1\], got 2$"),
    (lambda: SET(fraction=float("nan")), r"^SET.fraction must be a number in \(0, 1\], got nan$"),
    (lambda: RigL(fraction=True), r"^RigL.fraction must be a number .* got True$"),
    (lambda: SET(end=-3), r"^SET.end must be >= 0 optimizer steps, got -3$"),
    (lambda: RigL(end=1.5), r"^RigL.end as a fraction of training must lie in \[0, 1\]"),
    (lambda: SRSTE(decay=-1), r"^SRSTE.decay must be a finite number >= 0, got -1$"),
    (lambda: SRSTE(decay=float("inf")), r"^SRSTE.decay must be a finite number >= 0, got inf$"),
])
def test_a_regrowth_piece_refuses_a_bad_option_naming_its_own_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@dataclass(frozen=True)
class Cubed(Gradual):
    """A ramp of p^3 (a user's schedule)."""

    name: ClassVar[str] = "cubed-test"

    def ramp(self, progress: float) -> float:
        return progress ** 3


def test_a_users_schedule_is_registered_by_name_and_read_back():
    config = SparsityConfig(**UNSTRUCTURED, schedule=Cubed(start=0, end=10, frequency=5))
    assert config.schedule == "cubed-test" and SCHEDULES["cubed-test"] is Cubed
    assert parse_schedule(*config.parsed_schedule.as_list()) == config.parsed_schedule
    assert config.parsed_schedule.fraction(5) == 0.125
    assert SparsityConfig(**UNSTRUCTURED, schedule="cubed-test", end=10).parsed_schedule == (
        Cubed(start=0, end=10))

    @dataclass(frozen=True)
    class Other(Gradual):
        name: ClassVar[str] = "cubed-test"

    with pytest.raises(ValueError, match="schedule name 'cubed-test' is Cubed's"):
        register_schedule(Other)
    with pytest.raises(ValueError, match="register_schedule takes a Schedule subclass"):
        register_schedule(int)


@dataclass(frozen=True)
class Powered(Gradual):
    """A ramp of p^power: an option of its own, which the flat settings cannot carry."""

    name: ClassVar[str] = "powered-test"
    power: float = 1.0

    def ramp(self, progress: float) -> float:
        return progress ** self.power


def test_a_piece_with_an_option_the_flat_settings_lose_is_refused():
    """Not trained silently with the option's default (power 1.0 instead of 3.0)."""
    with pytest.raises(ValueError, match=r"schedule=Powered\(.*power=3.0\): its flat settings "
                                         r"\(start, end, frequency\) rebuild Powered\(.*"
                                         r"power=1.0\)"):
        SparsityConfig(**UNSTRUCTURED, schedule=Powered(start=0, end=10, power=3.0))
    config = SparsityConfig(**UNSTRUCTURED, schedule=Powered(start=0, end=10))  # the default
    assert config.parsed_schedule == Powered(start=0, end=10)


def test_the_callback_takes_pieces_and_checkpoints_plain_settings():
    sparse = SparsityCallback(**UNSTRUCTURED, schedule=GMP(start=0, end=4, frequency=2))
    make_trainer([sparse], max_epochs=1).fit(TinyNet(), make_loader(80))  # 5 steps
    state = sparse.state_dict()
    assert state["settings"]["schedule"] == "gmp" and state["settings"]["end"] == 4
    assert sparse.engine.updater.last_update == 4
