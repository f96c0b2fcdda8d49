"""ZB-H1 (``schedule="zero_bubble"``): each backward split into B (input gradient) and W (weight
gradient), run at different times; the weights after every step equal plain training's."""

from __future__ import annotations

import pytest
import torch

from tests.models import TiedNet, TinyNet, WrappedNet, fit_plain, token_loader
from tests.pipeline import assert_same_weights, fit_pipeline, twins


@pytest.mark.parametrize(
    "stages, chunks, recompute", [(2, 4, "never"), (2, 3, "always"), (4, 4, "always"), (4, 3, "never")]
)
def test_zero_bubble_weights_equal_plain_training(stages: int, chunks: int, recompute: str) -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(piped, stages, schedule="zero_bubble", chunks=chunks, recompute=recompute)
    assert_same_weights(reference, piped)


def test_zero_bubble_with_parameters_outside_the_sequential() -> None:
    torch.manual_seed(0)
    reference, piped = twins(WrappedNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="zero_bubble", chunks=4, recompute="except_last")
    assert_same_weights(reference, piped)


def test_zero_bubble_with_weights_tied_across_stages() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TiedNet())
    fit_plain(reference, token_loader())
    fit_pipeline(piped, 2, token_loader(), schedule="zero_bubble", chunks=3)
    assert_same_weights(reference, piped)


class ConvNet(TinyNet):
    """Convolutions, a norm and a head: W holds the convolutions' and the head's weight gradients,
    B the norms'."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 2, 3)),
            torch.nn.Conv2d(1, 4, 3, padding=1),
            torch.nn.GroupNorm(2, 4),
            torch.nn.ReLU(),
            torch.nn.Conv2d(4, 4, 3, padding=1),
            torch.nn.Flatten(),
            torch.nn.LayerNorm(24),
            torch.nn.Linear(24, 3),
        )


def test_zero_bubble_with_convolutions_and_norms() -> None:
    from tests.models import IN

    assert IN == 6  # the convolutions take the inputs as 1 x 2 x 3 images
    torch.manual_seed(0)
    reference, piped = twins(ConvNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="zero_bubble", chunks=3)
    assert_same_weights(reference, piped)


def test_zero_bubble_without_gradient_accumulation_fusion() -> None:
    torch.manual_seed(0)
    reference, piped = twins(TinyNet())
    fit_plain(reference)
    fit_pipeline(piped, 2, schedule="zero_bubble", chunks=4, gradient_accumulation_fusion=False)
    assert_same_weights(reference, piped)
