"""Hidden states a Hugging Face model records only because its forward turns the recording on.

transformers 5 wraps the forward of some vision and audio classes in ``filter_output_hidden_states``:
it calls the model with ``output_hidden_states=True`` whatever the caller asked, and drops the
hidden states from the output unless the caller asked for them. Of those classes (59 in
transformers 5.24; ``docs/models.md`` lists them), the audio heads (Wav2Vec2's, HuBERT's, WavLM's
... sequence and frame classification, x-vectors) read them only with ``use_weighted_layer_sum=True``
in their config; the others build their output from several layers' hidden states (backbones'
feature maps, BEiT's, DPT's and Segformer's segmentation and depth heads) or were not examined.

For the audio heads with ``use_weighted_layer_sum=False`` the recording reads no block's output: a
stage that skips other stages' blocks records only its own, and what it records is thrown away.
:mod:`lightning_pipe.runtime.blocks.reads` refuses any recording while a skipped block is called;
:func:`only_forced` tells when the recording is only that forced one, so such a model trains, and
nothing is carried for it. Every other forced recording is a read: its hidden states cross stages
under the schedules that carry recorded values (:mod:`lightning_pipe.runtime.crossing.carried`), and are
refused under the others (:func:`forced_read` names the model's setting).
"""

from __future__ import annotations

from typing import Any

from lightning_pipe.torch_internals import hf_forced_hidden_states_calls


def reads_hidden_states(model: Any, asked: Any) -> bool:
    """Whether a forced call of ``model`` uses its hidden states: its caller asked for them
    (``asked``), or the model is not an audio head whose config turns its layer sum off (the only
    forced recording known to be thrown away)."""
    config = getattr(model, "config", None)
    return bool(asked) or getattr(config, "use_weighted_layer_sum", True) is not False


def forced_read(recording: list[str]) -> str:
    """What uses the hidden states of the innermost forcing forward under way, where its caller did
    not ask for them (empty otherwise): the model's own setting or kind, which
    ``output_hidden_states=False`` cannot change."""
    calls = hf_forced_hidden_states_calls()
    if recording != ["hidden_states"] or not calls or calls[0][1] or not reads_hidden_states(*calls[0]):
        return ""
    model = calls[0][0]
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "use_weighted_layer_sum", False):
        return (
            f"{name} sums the hidden states of every layer (use_weighted_layer_sum=True in its config); set it to "
            "False to classify from the last hidden state"
        )
    return (
        f"{name} builds its output from the hidden states of several layers (a backbone's feature maps, a "
        "segmentation or depth head), which transformers records for it whatever the call asks"
    )


def forced_unread() -> bool:
    """Whether the innermost forcing forward under way records hidden states that nothing reads."""
    calls = hf_forced_hidden_states_calls()
    return bool(calls) and not reads_hidden_states(*calls[0])


def only_forced(recording: list[str]) -> bool:
    """Whether what the model records now (``hidden_states``, ``attentions`` ...) is only hidden
    states that the innermost forcing forward under way turned on and nothing reads."""
    return recording == ["hidden_states"] and forced_unread()
