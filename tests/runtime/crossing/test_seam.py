"""The executor's one interface for what crosses stages beside the hidden state: the skips' mail is a
``Crossing``, nothing else of skips or recorded values is named in the executor, and ``NoCrossing`` hands
every value through unchanged."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from lightning_pipe.runtime import executor
from lightning_pipe.runtime.crossing.seam import Crossing, NoCrossing, Packing
from lightning_pipe.runtime.crossing.skip_mail import SkipMail


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }


def test_the_skips_mail_is_a_crossing_with_the_same_signatures() -> None:
    wanted = _methods(Crossing)
    assert set(wanted) == {
        "after_forward",
        "post_receives",
        "before_forward",
        "after_backward",
        "before_backward",
        "clear",
    }
    for cls in (SkipMail, NoCrossing):
        got = _methods(cls)
        for name, signature in wanted.items():
            assert name in got, (cls.__name__, name)
            assert list(got[name].parameters) == list(signature.parameters), (cls.__name__, name)


def test_the_executor_names_nothing_of_skips_or_recorded_values() -> None:
    source = Path(executor.__file__).read_text().lower()
    for word in ("skip", "carried", "stash", "recorded"):
        assert word not in source, word


def test_nothing_crossing_hands_every_value_through() -> None:
    none = NoCrossing()
    x = torch.ones(2)
    sent = ((x,), Packing(True, (1, 2)))
    received = ([x], (True,), Packing())
    assert none.after_forward(0, 0, 2, "k", sent, [], None) is sent
    assert none.before_forward(1, 0, 2, "k", received, None) is received
    assert none.after_backward(1, 0, [x], []) == [x] and none.before_backward(0, 0, 2) == []
    assert Packing() == Packing(False, ())
