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
replicas: each module that holds one directly is wrapped too (:func:`outside_modules`), with what is
nested in it, a parametrized weight with its module, and modules sharing a weight on this
process (an encoder-decoder's embedding) as one unit (:func:`shard_units`, :func:`shard_groups`). A weight
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
from functools import partial
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import Tensor, nn
from torch.nn.utils.parametrize import ParametrizationList

from lightning_pipe.torch_internals import fsdp_init_grouped_root, fsdp_post_backward

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
    modules outside them (:func:`outside_modules`), each with everything nested in it: a module's forward may
    read a child's weight without calling the child (``nn.MultiheadAttention`` its ``out_proj``'s, in
    SigLIP's pooling head), so the child's parameters are gathered by the outer module's unit (ViT's
    embeddings hold the [CLS] token beside their patch convolution: one unit). A parametrized weight is one
    parameter: its originals (``conv.parametrizations.weight.original0``, weight norm) are sharded with the
    module it parametrizes."""
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
    return [*layers, *(unit for unit in units if not _nested(unit[1], units))]


def _nested(module: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether ``module`` is nested in another module of ``units`` (and so sharded in its unit)."""
    return any(m is not module and any(sub is module for sub in m.modules()) for _, m in units)


def _own_parameters(module: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> list[nn.Parameter]:
    """The parameters FSDP2 shards in ``module``'s unit: its own, less those of units nested in it."""
    nested = {id(m) for m in module.modules() if m is not module}
    theirs = {id(p) for _, m in units if id(m) in nested for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in theirs]


def shard_groups(units: Sequence[tuple[str, nn.Module]], layers: int) -> list[list[tuple[str, nn.Module]]]:
    """``units`` (named modules, the stage's ``layers`` first) in FSDP2's units: one each, except modules
    outside the split layers that hold one weight between them (BART's and T5's embedding, shared by the
    encoder, the decoder and the head), grouped into one unit (``fully_shard([a, b, ...])``), which
    shards the weight once. FSDP2 shards a unit's parameters less those of units nested in it. A weight
    a split layer shares with another unit of this process (a tie whose two ends one process holds) is
    refused, naming the modules' paths: sharded in two units, it would train wrong."""
    group_of = list(range(len(units)))

    def root(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    seen: dict[int, int] = {}
    for i, (name, module) in enumerate(units):
        for p in _own_parameters(module, units):
            j = seen.setdefault(id(p), i)
            if j == i or root(j) == root(i):
                continue
            if j < layers or i < layers:
                raise ValueError(
                    f"PipelineStrategy(data_parallel='shard') cannot shard this process's layers: a weight of shape "
                    f"{list(p.shape)} is held by both {units[j][0] or 'the model'} and {name or 'the model'} on this "
                    "process (a weight tied between them), and FSDP2 would shard it in two units. Use "
                    "data_parallel='replicate', or a schedule and balance that put the tied layers on different "
                    "processes."
                )
            group_of[root(i)] = root(j)
    groups: dict[int, list[tuple[str, nn.Module]]] = {}
    for i, unit in enumerate(units):
        groups.setdefault(root(i), []).append(unit)
    return list(groups.values())


class ShardedStage:
    """The FSDP2 units of one stage (its layers and the modules outside them: see :func:`shard_units`) and
    their per-step switches."""

    def __init__(self, units: Sequence[tuple[str, nn.Module]], mesh: Any, layers: int = 0) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.modules: list[Any] = []  # one module of each FSDP2 unit
        self._hooks = []
        grouped: list[list[nn.Module]] = []  # the units of several modules (a weight they share)
        for group in shard_groups(units, layers):
            members = [module for _, module in group]
            first = members[0]
            if isinstance(first, FSDPModule):
                self.modules.append(first)
            elif any(p.requires_grad for m in members for p in m.parameters()):
                fully_shard(members if len(members) > 1 else first, mesh=mesh, reshard_after_forward=False)
                self.modules.append(first)
            else:
                continue
            # a module outside the split layers that this stage's part of the step never runs (the final norm
            # on the first stage) has no FSDP state to finish or free; a grouped unit ran when any member did
            self._hooks += [m.register_forward_pre_hook(partial(self._note_run, first)) for m in members]
            if len(members) > 1:
                grouped.append(members)
        inside_others = {id(sub) for _, m in units for sub in m.modules() if sub is not m}
        for members in grouped:  # a group inside no other unit is its own root, as each other unit is
            if not any(id(m) in inside_others for m in members):
                fsdp_init_grouped_root(members[0])
        self._ran: set[int] = set()

    def _note_run(self, unit: nn.Module, module: nn.Module, args: Any) -> None:
        self._ran.add(id(unit))

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
