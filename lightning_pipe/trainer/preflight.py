"""What can be refused on the launching process, before any other process starts.

Every rank checks its split in the strategy's setup, after the processes have started and joined
the process group: a mistake found there costs the start of every process and is raised once per
rank. What the module and the arguments alone decide (what :func:`~lightning_pipe.resolve.resolve`
refuses for the layout, the schedule's layout, more stages than
layers, a process left without parameters, a schedule that a block container cannot run, weight
versions or sharded weights for a model that trains parameters outside its split layers or ties
weights across stages) is
checked here first, on the process that launches the others, so that it fails in a second with
one error. What needs measuring (``plan="auto"``, ``balance="time"``/``"memory"``) or a module
whose layers ``configure_model()`` builds is left to the setup.
"""

from __future__ import annotations

from torch import nn

from lightning_pipe.assembly.refusals import check_async, check_shard
from lightning_pipe.assembly.split import decide_split
from lightning_pipe.config import PipelineConfig
from lightning_pipe.partition import find_sequential
from lightning_pipe.resolve import resolve
from lightning_pipe.runtime.topology import Layout
from lightning_pipe.schedules import is_async
from lightning_pipe.trainer.compatibility import as_misconfiguration, check_async_accumulation
from lightning_pipe.trainer.stage_setup import for_this_world


def builds_layers_later(module: nn.Module) -> bool:
    """Whether ``module`` defines ``configure_model()``, where it may build the layers after the launch."""
    hook = getattr(type(module), "configure_model", None)
    return hook is not None and getattr(hook, "__qualname__", "").split(".")[0] not in ("LightningModule", "ModelHooks")


def check_before_launch(
    module: nn.Module | None, config: PipelineConfig, layout: Layout, accumulate_grad_batches: int = 1
) -> None:
    """Raise what the split of ``module`` into ``layout`` would raise on every rank, where the module and
    the arguments decide it (and the Trainer's ``accumulate_grad_batches``, which an asynchronous schedule
    refuses). Nothing is split, built or measured here."""
    config = for_this_world(config, layout.world_size, layout.replicas)  # an elastic restart's own
    check_async_accumulation(config.schedule, accumulate_grad_batches)
    planned = config.plan == "auto"  # the planner settles the activations in the setup, with the split
    resolve(config.replace(recompute="never", offload=False) if planned else config, layout)  # the setup's, dry
    if module is None or planned:
        return
    try:
        _, layers = find_sequential(module, config.module)
    except (ValueError, TypeError):
        if builds_layers_later(module):
            return  # the layers may not exist before configure_model(): the setup checks them
        raise
    with as_misconfiguration():  # the layout's refusals, as the setup raises them
        decision = decide_split(module, layers, config, layout)  # split_module's own steps, as a dry run
        # weights tied across stages: known where the balance is (not a measured one)
        _check_versions(module, layers, config, layout, bool(decision.tied))


def _check_versions(
    module: nn.Module, layers: nn.Sequential | nn.ModuleList, config: PipelineConfig, layout: Layout, tied: bool
) -> None:
    """The refusals of :func:`~lightning_pipe.assembly.split.pipeline_for` that the module decides: weight
    versions (the asynchronous schedules) and sharded weights kept for the split layers only, while the model
    trains parameters outside them (a block container's embeddings and head), or ties weights across stages."""
    inside = {id(p) for p in layers.parameters()}
    outside = [p for p in module.parameters() if id(p) not in inside]
    blocks = None if isinstance(layers, nn.Sequential) else config.module  # the messages name the container
    if config.data_parallel == "shard" and layout.replicas > 1:
        check_shard(config.schedule, outside, tied, blocks)
    if is_async(config.schedule):
        chunks = config.num_microbatches(layout.stages)
        check_async(config.schedule, module, outside, tied, layout.stages, chunks, None, blocks)
