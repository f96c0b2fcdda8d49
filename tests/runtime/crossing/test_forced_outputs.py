"""Which recordings of hidden states, forced on by transformers' ``filter_output_hidden_states``,
read nothing of other stages' blocks (the audio heads without a layer sum) and which stay refused."""

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_pipe.runtime.crossing.forced_outputs import forced_read, only_forced, reads_hidden_states


def model(**config: Any) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_only_an_audio_head_without_its_layer_sum_and_not_asked_reads_nothing() -> None:
    assert not reads_hidden_states(model(use_weighted_layer_sum=False), None)
    assert not reads_hidden_states(model(use_weighted_layer_sum=False), False)
    assert reads_hidden_states(model(use_weighted_layer_sum=False), True)  # the caller asked: it gets them
    assert reads_hidden_states(model(use_weighted_layer_sum=True), None)
    assert reads_hidden_states(model(), None)  # a backbone, a segmentation head: feature maps from the layers


def test_the_forcing_call_under_way_is_found_from_its_frame() -> None:
    """The forced call's own ``output_hidden_states`` (what its caller asked) decides, read from the
    wrapper's frame while the model's forward runs."""
    backbone_utils = pytest.importorskip("transformers.backbone_utils")
    from transformers.utils.generic import can_return_tuple

    seen: dict[str, Any] = {}

    class Head:
        def __init__(self, **config: Any) -> None:
            self.config = SimpleNamespace(output_hidden_states=False, return_dict=True, **config)

        @can_return_tuple
        @backbone_utils.filter_output_hidden_states
        def forward(self, **kwargs: Any) -> dict:
            seen["only_forced"] = only_forced(["hidden_states"])
            seen["read"] = forced_read(["hidden_states"])
            return {"hidden_states": (), "logits": None}

    Head(use_weighted_layer_sum=False).forward()
    assert seen == {"only_forced": True, "read": ""}
    Head(use_weighted_layer_sum=False).forward(output_hidden_states=True)
    assert seen == {"only_forced": False, "read": ""}  # asked for: the usual refusal speaks
    Head(use_weighted_layer_sum=True).forward()
    assert not seen["only_forced"] and "use_weighted_layer_sum=True" in seen["read"]
    Head().forward()
    assert not seen["only_forced"] and "hidden states of several layers" in seen["read"]
    assert not only_forced(["hidden_states"])  # no forcing call under way
