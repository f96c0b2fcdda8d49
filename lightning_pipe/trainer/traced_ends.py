"""What only the end stages of a model of the user's own need, traced in one micro-batch of the run's own step
before the split (:mod:`lightning_pipe.partition.stages.end_trace`).

Global rank 0 runs the step the Trainer is about to run (``training_step`` when fitting, ``predict_step`` when
predicting, ...) on the first micro-batch of the run's first batch, without gradients and without logging, and gives
every rank its answer, so all split alike. The run is left as it was: the random state (the sampler's draw, dropout)
and the buffers (batch-norm statistics) are restored; a model with nothing beside its split layers is not traced.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition.measure.measured import MeasureInputs
from lightning_pipe.partition.stages.end_trace import TracedEnds, trace_ends
from lightning_pipe.partition.stages.hf_init import is_pretrained_model
from lightning_pipe.partition.stages.materialize import has_meta_tensors
from lightning_pipe.runtime.microbatch import split
from lightning_pipe.schedules import is_async, traits
from lightning_pipe.trainer import internals

#: the step each of the Trainer's functions runs
STEPS = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


def traces_ends(module: nn.Module, layers: nn.Module, config: PipelineConfig, stages: int) -> bool:
    """Whether the split traces a step for its ends: a model of the user's own (a Hugging Face model names its
    embeddings), built with its tensors, on several stages of a synchronous schedule that runs each stage once (the
    asynchronous ones and Chimera keep what is outside the split layers on every stage), with an end not named."""
    if config.first_stage is not None and config.last_stage is not None:
        return False
    if stages < 2 or is_async(config.schedule) or traits(config.schedule).mirrored:
        return False
    if any(is_pretrained_model(m) and any(c is layers for c in m.modules()) for m in module.modules()):
        return False
    inside = {id(p) for p in layers.parameters()}
    if all(id(p) in inside for p in module.parameters()):
        return False  # nothing beside the split layers to place: no batch is drawn (a dataset may count its reads)
    return not has_meta_tensors(module)


@contextmanager
def _untouched(module: Any, device: torch.device) -> Iterator[None]:
    """The step runs with logging switched off (``log_dict`` goes through ``log``), and leaves the random state
    and the buffers as they were."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = [device.index or 0] if device.type == "cuda" else []
    python_state = random.getstate()  # a custom sampler may draw from Python's random state, or numpy's
    np = sys.modules.get("numpy")  # only where something imported it: nothing drew from it otherwise
    numpy_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=devices), internals.routed_log(module, lambda *a, **k: None):
        try:
            yield
        finally:
            random.setstate(python_state)
            if np is not None:
                np.random.set_state(numpy_state)
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])


def traced_ends(
    module: Any, layers: nn.Sequential | nn.ModuleList, config: PipelineConfig, stages: int, inputs: MeasureInputs
) -> TracedEnds | None:
    """Global rank 0's trace, on every rank; None where the split traces nothing (:func:`traces_ends`)."""
    if not traces_ends(module, layers, config, stages):
        return None
    traced = None
    if inputs.is_source:
        step = getattr(module, STEPS.get(module.trainer.state.fn, "training_step"))
        with _untouched(module, inputs.device):
            try:  # drawn before the trace, which would count the draw's reads of the parameters
                microbatch = split(inputs.batch(), config.num_microbatches(stages))[0]
            except Exception as error:
                traced = TracedEnds(failed=f"no batch to trace: {type(error).__name__}: {error}")
            else:

                def run() -> None:
                    with torch.no_grad(), inputs.context():
                        step(microbatch, 0)

                traced = trace_ends(module, layers, run)
    return inputs.broadcast(traced)
