"""A schedule built from its resolved traits equals the one its name builds, without a lookup by name."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import TRAITS, VIRTUAL_STAGES, build, positions_for, schedule_for, stage_positions, traits


@pytest.mark.parametrize("name", sorted(TRAITS))
@pytest.mark.parametrize("rendezvous", [False, True])
def test_the_traits_build_what_the_name_builds(name: str, rendezvous: bool) -> None:
    p, m, v = 4, 8, VIRTUAL_STAGES.get(name, 1)
    assert schedule_for(TRAITS[name], p, m, v, rendezvous) == build(name, p, m, v, rendezvous)
    assert positions_for(TRAITS[name], p, v) == stage_positions(name, p, v)


def test_a_texts_traits_hold_its_parsed_schedule() -> None:
    text = "0F0,0F1,3F0,3I0,3W0,3F1,3I1,3W1,0I0,0W0,0I1,0W1\n1F0,2F0,1F1,2F1,2I0,2W0,1I0,1W0,2I1,2W1,1I1,1W1\n"
    t = traits(text)
    assert positions_for(t, 2, t.virtual_stages) == [0, 1, 1, 0]  # where the text computes each stage
    assert schedule_for(t, 2, 2, 2).actions == t.text.actions  # type: ignore[union-attr]
    assert schedule_for(t, 2, 2, 2, rendezvous=True).actions != t.text.actions  # regrouped: deadlocks as written
    assert schedule_for(t, 2, 1, 2).num_microbatches == 1  # a short last batch runs the text's first
