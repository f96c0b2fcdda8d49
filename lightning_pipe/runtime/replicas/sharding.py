"""``data_parallel="shard"``: each stage sharded over its replicas with FSDP2 (ZeRO-3 inside the
pipeline, as torchtitan composes them).

Every layer of the stage that has parameters is wrapped with ``fully_shard`` over the mesh's
``dp`` dimension, so its parameters, gradients and optimizer state are split across the replicas.
A pipeline step runs many micro-batch forwards and backwards on the same weights, so, as
``torch.distributed.pipelining`` does with FSDP:

- the parameters are gathered by the first forward of the step and kept (``reshard_after_forward``
  and ``reshard_after_backward`` off) over the step's micro-batches;
- the micro-batches' gradients accumulate unsharded (``set_requires_gradient_sync(False)``), and
  :meth:`ShardedStage.finish` reduce-scatters them once after the stage's last backward, which
  also frees the gathered parameters.

Parameters outside the split layers that this rank holds (a block container's embeddings, final
norm and head; a Sequential's pre- and post-processing) are sharded the same way, over the same
replicas: each module that holds one directly is wrapped too (:func:`outside_modules`). A weight
tied across stages (an embedding tied to the head across the first and last stage) is sharded on
each stage that holds it; the stages have as many replicas, so replica ``r`` of each holds the
same rows, and their gradients are summed shard by shard over the tie's ranks of replica ``r``
(:mod:`lightning_pipe.runtime.grads.gradients`), as those of the parameters every stage holds are over
the stages.

Checkpoints keep each replica's shards in a ``torch.distributed.checkpoint`` directory per stage
(:func:`lightning_pipe.checkpoint.write_sharded_stage`); loading reads a stage's whole tensors and
splits them for the current layout (:func:`shard_like`), so they load under any layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList

from lightning_pipe.torch_internals import fsdp_post_backward

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local(value: Tensor) -> Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    return value.to_local() if is_dtensor(value) else value


def full_tensor(value: Any) -> Any:
    """The whole tensor of a sharded one (collective over its mesh: every replica calls it), else
    the value itself."""
    return value.full_tensor() if is_dtensor(value) else value


def shard_like(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (a whole tensor) split like the sharded tensor ``like``; ``value`` itself when
    ``like`` is not sharded."""
    if not is_dtensor(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements)


def outside_modules(model: nn.Module, stage: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` outside ``stage`` that directly hold a trainable parameter that
    ``stage`` does not (by identity): what :class:`ShardedStage` shards beside the stage's layers."""
    inside = {id(m) for m in stage.modules()}
    held = {id(p) for p in stage.parameters()}
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if any(p.requires_grad and id(p) not in held for p in module.parameters(recurse=False)):
            if any(m is stage for m in module.modules()):
                raise ValueError(
                    f"PipelineStrategy(data_parallel='shard') shards the parameters outside the split layers with "
                    f"their modules, but {name or 'the LightningModule'} ({type(module).__name__}) holds one directly "
                    "and also holds the split layers. Move that parameter into a submodule of its own (or into the "
                    "split layers), or use data_parallel='replicate'."
                )
            found.setdefault(id(module), module)
    return list(found.values())


def shard_units(model: nn.Module, stage: nn.Module) -> list[tuple[str, nn.Module]]:
    """What :class:`ShardedStage` wraps, each named by its path in ``model``: the stage's layers, then the
    modules outside them (:func:`outside_modules`), a module after those nested in it, so that FSDP2 leaves
    a nested unit's parameters to it (ViT's embeddings hold the [CLS] token beside their patch convolution).
    A parametrized weight is one parameter: its originals (``conv.parametrizations.weight.original0``,
    weight norm) are sharded with the module it parametrizes."""
    paths: dict[int, str] = {}
    for name, module in model.named_modules():
        paths.setdefault(id(module), name)
    layers = [(paths.get(id(layer), f"layer {i}"), layer) for i, layer in enumerate(stage.children())]
    outside: dict[int, tuple[str, nn.Module]] = {}
    for module in outside_modules(model, stage):
        name = paths.get(id(module), type(module).__name__)
        if isinstance(module, ParametrizationList) and ".parametrizations." in f".{name}":
            name = f".{name}".rsplit(".parametrizations.", 1)[0].removeprefix(".")
            module = model.get_submodule(name)
        outside.setdefault(id(module), (name, module))
    units = list(outside.values())
    return [*layers, *sorted(units, key=lambda unit: -len(_ancestors(unit[1], units)))]  # the deepest first


def _ancestors(module: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The modules of ``units`` that ``module`` is nested in."""
    return [m for _, m in units if m is not module and any(sub is module for sub in m.modules())]


def _own_parameters(module: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> list[nn.Parameter]:
    """The parameters FSDP2 shards in ``module``'s unit: its own, less those of units nested in it."""
    nested = {id(m) for m in module.modules() if m is not module}
    theirs = {id(p) for _, m in units if id(m) in nested for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in theirs]


def refuse_shared_units(units: Sequence[tuple[str, nn.Module]]) -> None:
    """FSDP2 shards each unit's parameters (less those of units nested in it) as one: a parameter two of
    ``units`` (named modules) hold (a weight tied between two layers of this process, or between a layer
    and a module outside the split layers) would be sharded twice, and its two units would train it
    wrong. Refused, naming the modules' paths."""
    seen: dict[int, int] = {}
    for i, (name, module) in enumerate(units):
        for p in _own_parameters(module, units):
            j = seen.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"PipelineStrategy(data_parallel='shard') cannot shard this process's layers: a weight of shape "
                    f"{list(p.shape)} is held by both {units[j][0] or 'the model'} and {name or 'the model'} on this "
                    "process (a weight tied between them), and FSDP2 would shard it in two units. Use "
                    "data_parallel='replicate', or a schedule and balance that put the tied layers on different "
                    "processes."
                )


class ShardedStage:
    """The FSDP2 units of one stage (its layers and the modules outside them: see :func:`shard_units`) and
    their per-step switches."""

    def __init__(self, units: Sequence[tuple[str, nn.Module]], mesh: Any) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.modules: list[Any] = []
        refuse_shared_units(units)
        for _, layer in units:
            if isinstance(layer, FSDPModule):
                self.modules.append(layer)
            elif any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
                self.modules.append(layer)
        # a module outside the split layers that this stage's part of the step never runs (the final norm
        # on the first stage) has no FSDP state to finish or free
        self._ran: set[int] = set()
        self._hooks = [m.register_forward_pre_hook(self._note_run) for m in self.modules]

    def _note_run(self, module: nn.Module, args: Any) -> None:
        self._ran.add(id(module))

    def _run(self) -> list[Any]:
        return [m for m in self.modules if id(m) in self._ran]

    def begin(self) -> None:
        """A training step starts: keep the gathered parameters and accumulate unsharded gradients."""
        for module in self.modules:
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)

    def finish(self) -> None:
        """The stage's last backward is over: reduce-scatter the step's gradients once and free the
        gathered parameters."""
        for module in self.modules:
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
        for module in self._run():
            fsdp_post_backward(module)

    def reshard(self) -> None:
        """Free parameters gathered by forward-only steps (evaluation)."""
        for module in self._run():
            module.reshard()
