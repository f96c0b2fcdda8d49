"""One stage: its layers (under their original names) and the per-micro-batch work on them.

:class:`StageModule` replaces the user's ``nn.Sequential`` in the LightningModule, so the
module's own ``forward`` and step methods run unchanged: when the step calls the Sequential, the
stage module either runs the local layers and stops the step there (first stage), or ignores
the argument and runs the local layers on the activation received from the previous stage (last
stage). :class:`StageRunner` does that for each micro-batch and keeps what the backward needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_pipe.runtime.activations.meter import SavedActivationMeter
from lightning_pipe.runtime.activations.offload import ActivationOffload
from lightning_pipe.runtime.activations.recomputation import RECOMPUTE_MODES, keep_buffers
from lightning_pipe.runtime.around.held_layers import HeldLayer, LoopEntry, SequentialLoop, refuse_hooks_elsewhere
from lightning_pipe.runtime.around.loss_terms import refuse_parameter_terms
from lightning_pipe.runtime.asynchronous.versions import WeightVersions, on_version
from lightning_pipe.runtime.blocks.container import (
    BlockDrive,
    BlockStage,
    StageExit,
    held_stages,
    layer_parameter_names,
)
from lightning_pipe.runtime.blocks.reads import HeldBlockRead, refuse_held, tensors_in
from lightning_pipe.runtime.crossing.carried import (
    CARRIED_KEYS,
    Carry,
    Returned,
    carrying_refused,
    crossing_line,
    split_codes,
)
from lightning_pipe.runtime.crossing.records import keep_records
from lightning_pipe.runtime.crossing.seam import Packing, Received, Sent
from lightning_pipe.runtime.crossing.skips import skip_scope, take_skips
from lightning_pipe.runtime.grads import weight_store
from lightning_pipe.runtime.grads.weight_store import WeightWork
from lightning_pipe.runtime.microbatch import as_tuple, from_tuple
from lightning_pipe.torch_internals import child_slot, filled_slots


class StageModule(nn.Sequential):
    """The layers of one stage, keyed by their index in the unsplit Sequential."""

    def __init__(
        self,
        layers: OrderedDict[str, nn.Module],
        stage: int,
        num_stages: int,
        positions: Sequence[tuple[str, HeldLayer]] | None = None,
    ) -> None:
        super().__init__(layers)
        #: every position of the unsplit Sequential: its key and the stand-in for when another stage holds it
        #: (default: the layers given are the whole Sequential)
        self._positions: list[tuple[str, HeldLayer | None]] = (
            list(positions) if positions is not None else [(key, None) for key in layers]
        )
        keys = [key for key, _ in self._positions]
        own = [keys.index(key) for key in layers]
        #: the positions of this module's layers in the unsplit Sequential: ``[start, stop)``
        self.span = (min(own), max(own) + 1) if own else (0, 0)
        #: the Sequential's name in the model (``"layers"``), for messages
        self.path = ""
        self._loop: SequentialLoop | None = None
        self.stage = stage
        self.num_stages = num_stages
        #: the split stages this module holds and their count, for errors (see :func:`held_stages`)
        self.held: tuple[tuple[int, ...], int] = ((stage,), num_stages)
        self.hook: Callable[[Any], Any] | None = None
        # per layer: (name in this module, name inside the layer) of its parameters, for versions
        self._param_names = layer_parameter_names(filled_slots(self))
        #: whether the first layer changes its input in place (``nn.ReLU(inplace=True)`` at a stage's
        #: start, as a split may leave it)
        self.modifies_input = len(layers) > 0 and _modifies_input(next(iter(filled_slots(self).values())))
        #: skip connections (:mod:`lightning_pipe.skips`), per earlier split stage that stashes names this
        #: one pops, and per later one that pops names this one stashes: the names (set at setup, from the
        #: layers' declarations; the executor sends each group straight to its stage)
        self.skip_sources: tuple[tuple[int, tuple[str, ...]], ...] = ()
        self.skip_targets: tuple[tuple[int, tuple[str, ...]], ...] = ()
        #: the names the Sequential's recording hooks record (:mod:`lightning_pipe.runtime.crossing.records`)
        self.records: tuple[str, ...] = ()

    @property
    def skips_in(self) -> tuple[str, ...]:
        """The names this stage's layers pop from earlier stages, in :attr:`skip_sources`' order."""
        return tuple(n for _, names in self.skip_sources for n in names)

    @property
    def skips_out(self) -> tuple[str, ...]:
        """The names this stage's layers stash for later stages, in :attr:`skip_targets`' order."""
        return tuple(n for _, names in self.skip_targets for n in names)

    def __len__(self) -> int:
        return len(self._positions)

    def __iter__(self) -> Iterator[Any]:
        return (self._entry(i) for i in range(len(self)))

    def __getitem__(self, index: int | slice) -> Any:
        """Layer ``index`` of the unsplit Sequential (see :mod:`lightning_pipe.runtime.around.held_layers`); a slice
        as ``nn.Sequential`` gives it (a list of the loop's entries while the step runs)."""
        if isinstance(index, slice):
            picked = range(len(self))[index]
            if self._loop is not None:
                return [self._entry(i) for i in picked]
            return nn.Sequential(OrderedDict((self._positions[i][0], self._entry(i)) for i in picked))
        try:
            position = range(len(self))[index]
        except IndexError:
            raise IndexError(
                f"index {index} is out of range for the pipelined Sequential of {len(self)} layers"
            ) from None
        return self._entry(position)

    def stand_ins_before(self, position: int) -> list[HeldLayer]:
        """The stand-ins of the layers before ``position`` that other stages hold."""
        return [h for key, h in self._positions[:position] if h is not None and child_slot(self, key) is None]

    def _entry(self, position: int) -> Any:
        key, stand_in = self._positions[position]
        layer = child_slot(self, key)
        found = layer if layer is not None else stand_in
        assert found is not None
        if self._loop is not None:
            return LoopEntry(self._loop, position, found)
        return found

    def forward(self, value: Any) -> Any:
        if self._loop is not None and self._loop.called >= 0:
            raise RuntimeError(
                "The step both looped over the pipelined Sequential and called it. Under the pipeline the step may "
                "run it once per micro-batch."
            )
        if self.hook is not None:
            return self.hook(value)
        if self.num_stages > 1:
            raise RuntimeError(
                f"This module holds {held_stages(self.held)}; it runs inside the "
                "Trainer's steps. To use the whole model outside the Trainer, load a consolidated checkpoint."
            )
        return self.run_layers(value, recompute=False)

    @contextmanager
    def routed(self, hook: Callable[[Any], Any], span: tuple[int, int] | None = None) -> Iterator[SequentialLoop]:
        """While the user's step runs: its call of the Sequential goes to ``hook`` (the stage's part of
        the micro-batch), and so does a loop over it at the first of ``span``'s positions (the running
        stage's; default: this module's), the model's code unchanged."""
        start, stop = span if span is not None else self.span
        self.hook = hook
        self._loop = SequentialLoop(start, stop, len(self), hook)
        try:
            yield self._loop
        finally:
            self.hook = None
            self._loop = None

    def run_layers(
        self,
        value: Any,
        recompute: bool,
        params: dict[str, Tensor] | None = None,
    ) -> Any:
        """The stage's layers on ``value``; with ``recompute`` their activations are recomputed
        in the backward, with the RNG state of the forward, so dropout draws the same mask, and
        leaving the buffers the forward updated (BatchNorm's running statistics) as they were, so
        each micro-batch counts once. With ``params`` (names as in ``named_parameters``) the layers
        run on those tensors instead of their own parameters (a stashed weight version)."""
        if not recompute:
            return self._chain(self._guard(value), params)
        tensors, was_tuple = as_tuple(value)

        def layers(*flat: Tensor) -> Any:
            return self._chain(self._guard(from_tuple(flat, was_tuple)), params)

        return torch_checkpoint(
            layers, *tensors, use_reentrant=False, preserve_rng_state=True, context_fn=lambda: keep_buffers(self)
        )

    def run_stage(
        self, value: Any, skips: Sequence[Tensor], recompute: bool, params: dict[str, Tensor] | None = None
    ) -> tuple[Any, list[Tensor]]:
        """:meth:`run_layers` with the stage's skip connections: ``skips`` (one per ``skips_in``) are
        what its layers may pop; returns the output and the tensors of ``skips_out``. Recomputed in
        the backward with the same skips in, where ``recompute``."""
        if not self.skips_in and not self.skips_out:
            return self.run_layers(value, recompute, params), []

        def run(value: Any, skips: Sequence[Tensor]) -> tuple[Any, list[Tensor]]:
            with skip_scope(dict(zip(self.skips_in, skips))) as scope:
                output = self._chain(self._guard(value), params)
            if self.stage == self.num_stages - 1:  # what recording hooks recorded: for the step to read
                keep_records((n, scope.pop(n)) for n in self.records if n in scope)
            return output, take_skips(scope, self.skips_out, self.stage)

        if not recompute:
            return run(value, skips)
        tensors, was_tuple = as_tuple(value)

        def layers(*flat: Tensor) -> tuple[Any, ...]:
            output, leaving = run(from_tuple(flat[: len(tensors)], was_tuple), flat[len(tensors) :])
            return (output, *leaving)

        result = torch_checkpoint(
            layers, *tensors, *skips, use_reentrant=False, preserve_rng_state=True,
            context_fn=lambda: keep_buffers(self),
        )  # fmt: skip
        return result[0], list(result[1:])

    def _guard(self, value: Any) -> Any:
        """A copy of the stage's input where the first layer changes it in place and it needs a
        gradient: autograd refuses that on a leaf (the received activation), and a checkpointed
        stage must find its input unchanged when it recomputes."""
        if not (self.modifies_input and torch.is_grad_enabled()):
            return value
        if not isinstance(value, (Tensor, tuple, list)) or not all(isinstance(t, Tensor) for t in _as_list(value)):
            return value  # not an activation the pipeline passes (the first stage's own input)
        tensors, was_tuple = as_tuple(value)
        return from_tuple(tuple(t.clone() if t.requires_grad else t for t in tensors), was_tuple)

    def _chain(self, value: Any, params: dict[str, Tensor] | None) -> Any:
        for key, layer in filled_slots(self).items():
            if params is None:
                value = layer(value)
                continue
            own = {inner: params[full] for full, inner in self._param_names[key]}
            value = functional_call(layer, own, (value,)) if own else layer(value)
        return value


def _as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, Tensor) else list(value)


def _modifies_input(layer: nn.Module | None) -> bool:
    """Whether ``layer`` starts by changing its input in place (``nn.ReLU(inplace=True)``, or a
    Sequential that begins with one)."""
    while isinstance(layer, nn.Sequential) and len(layer) > 0:
        layer = layer[0]
    return bool(getattr(layer, "inplace", False))


def recomputes(mode: str, microbatch: int, num_microbatches: int) -> bool:
    """torchgpipe's modes: ``always``, ``except_last`` (all but the last micro-batch), ``never``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != num_microbatches - 1
    if mode == "never":
        return False
    raise ValueError(f"Unknown recompute mode {mode!r}. Valid: {', '.join(RECOMPUTE_MODES)}.")


#: Runs the user's step for a micro-batch. On the first stage its return value is ignored (the
#: step is cut short); on the last stage it returns the tensor to backpropagate (already weighted),
#: or None when nothing is backpropagated (evaluation).
StepFn = Callable[[int], Tensor | None]


class StageRunner:
    """Forward and backward of one stage, one micro-batch at a time."""

    def __init__(
        self,
        module: StageModule | BlockStage,
        recompute: str = "never",
        versions: WeightVersions | None = None,
        host: StageModule | BlockStage | None = None,
        offload: int | None = None,
    ) -> None:
        self.module = module
        # the module in the user's LightningModule whose calls the step makes: the stage itself, or,
        # with several stages per rank, the module that holds all of them
        self.host = host if host is not None else module
        self.stage = module.stage
        self.num_stages = module.num_stages
        self.recompute = recompute  # activation recomputation: "always", "except_last" or "never"
        self.versions = versions  # asynchronous schedules: micro-batch g of batch b runs on version b
        self.completed: dict[int, dict[str, Tensor | None]] = {}  # batch -> its gradient on this stage
        self.trace: list[tuple[str, int, int]] | None = None  # (kind, micro-batch, version) when tracing
        self._saved: dict[int, tuple[list[Tensor], Any]] = {}
        # split backward: per micro-batch, the weight-gradient work B left for W
        self._weights_due: dict[int, list[WeightWork]] = {}
        self._microbatches = 1
        self.meter: SavedActivationMeter | None = None  # benchmarks: peak bytes saved for backward
        # PipeMare: saved-tensor hooks around a training forward that give its backward the weights
        # of the backward's moment (see lightning_pipe.runtime.asynchronous.pipemare), given the meter if any
        self.saving: Callable[[SavedActivationMeter | None], AbstractContextManager[Any]] | None = None
        #: why this schedule cannot carry values recorded by blocks between stages (None: it can)
        self.carry_refusal: str | None = None
        #: asynchronous schedules: the user's model and the names in it of the parameters outside the
        #: split layers that a weight version holds too, swapped for the version's while the step runs
        self.model: nn.Module | None = None
        self.outside: tuple[str, ...] = ()
        #: where the lines that say what crosses beside the hidden state go (the Trainer's rank-0 info)
        self.tell: Callable[[str], None] = lambda line: None
        self._told_crossing = False
        self._terms_checked = False  # the first training loss read no layer's parameter outside the call
        self._hooks_checked = False  # no forward hook on a layer of an earlier stage
        self._told_returned = False
        #: saved activations beyond ``offload`` resident micro-batches go to host memory (None: all stay)
        self.offload = ActivationOffload(offload) if offload is not None else None
        if self.offload is not None:
            self.offload.ignore(module.parameters())

    @property
    def weights_due(self) -> Mapping[int, list[WeightWork]]:
        """Per micro-batch, the weight-gradient work B deferred that W has not run yet (benchmarks count its bytes)."""
        return self._weights_due

    def reset(self) -> None:
        """Forget every micro-batch in flight."""
        self._saved.clear()
        self._weights_due.clear()
        if self.offload is not None:
            self.offload.reset()

    def enable_trace(self) -> list[tuple[str, int, int]]:
        """Record which weight version each forward used and which version each backward's
        gradients reached (for tests); call before the first step."""
        self.trace = []
        self._backward_of = -1
        if self.versions is not None:
            trace = self.trace
            self.versions.on_gradient = lambda version, name: trace.append(("B", self._backward_of, version))
        return self.trace

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(
        self, microbatch: int, num_microbatches: int, received: Received | None, step: StepFn | None = None
    ) -> Sent | None:
        """Run micro-batch ``microbatch``; returns what to send on (its tensors and their packing), or None on the
        last stage. ``received`` is what the previous stage sent, None on the first stage; ``step``
        runs the user's step for a micro-batch (needed on the first and last stages, and for block
        containers on every stage)."""
        saving = self.saving if self.saving is not None and torch.is_grad_enabled() else None
        if saving is None and self._offloads():
            saving = self._offloading(microbatch)
        if self.meter is None:
            with saving(None) if saving is not None else nullcontext():
                return self._forward(microbatch, num_microbatches, received, step)
        if self.versions is not None:
            self.meter.ignore(self._version_tensors())
        with self.meter.hooks(), saving(self.meter) if saving is not None else nullcontext():
            return self._forward(microbatch, num_microbatches, received, step)

    def _offloads(self) -> bool:
        """Whether the next training forward's saved tensors go to host memory: the stage already
        keeps ``offload`` micro-batches' on the device (one waiting for its W counts)."""
        if self.offload is None or not torch.is_grad_enabled():
            return False
        resident = (self._saved.keys() | self._weights_due.keys()) - self.offload.held.keys()
        return self.offload.chooses(len(resident))

    def _offloading(self, microbatch: int) -> Callable[[SavedActivationMeter | None], AbstractContextManager[Any]]:
        offload = self.offload
        assert offload is not None
        if self.versions is not None:
            offload.ignore_versions(self._version_tensors())
        return lambda meter: offload.hooks(microbatch, meter)

    def _version_tensors(self) -> Iterator[Tensor]:
        """The tensors of every weight version held: parameters, neither metered nor offloaded."""
        assert self.versions is not None
        return (t for v in self.versions.held() for t in self.versions.params(v).values())

    def _forward(
        self, microbatch: int, num_microbatches: int, received: Received | None, step: StepFn | None
    ) -> Sent | None:
        training = torch.is_grad_enabled()
        recompute = training and recomputes(self.recompute, microbatch % num_microbatches, num_microbatches)
        self._microbatches = num_microbatches
        params = None
        if self.versions is not None and training:
            version = microbatch // num_microbatches
            params = self.versions.params(version)
            if self.trace is not None:
                self.trace.append(("F", microbatch, version))
        leaves: list[Tensor] = []
        skips: list[Tensor] = []  # skip connections from earlier stages, after the hidden state
        if received is not None:
            tensors, flags, packing = received
            leaves = [t.requires_grad_(True) if rg and training else t for t, rg in zip(tensors, flags)]
            hidden = len(leaves) - len(getattr(self.module, "skips_in", ()))
            value, skips = from_tuple(tuple(leaves[:hidden]), packing.was_tuple), leaves[hidden:]
        if isinstance(self.module, BlockStage):
            return self._forward_blocks(microbatch, num_microbatches, received, leaves, recompute, params, step)
        module = self.module  # a StageModule from here on
        leaving: list[Tensor] = []
        if self.is_last:
            calls = 0

            def inject(argument: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls > 1:
                    raise RuntimeError(
                        "The step called the pipelined Sequential twice for one micro-batch. Under the pipeline "
                        "the step may call it (or self(...)) once per batch."
                    )
                output = module.run_stage(argument if received is None else value, skips, recompute, params)[0]
                produced.extend(tensors_in(output))
                return output

            if not self._hooks_checked and isinstance(self.host, StageModule):  # hooks on earlier stages' layers
                self._hooks_checked = True
                refuse_hooks_elsewhere(self.host.stand_ins_before(module.span[0]), self.stage)
            produced: list[Tensor] = []
            loss = self._run_step(step, microbatch % num_microbatches, inject, params)
            if calls == 0:
                raise RuntimeError(self._not_called())
            refuse_held(loss, "The step's loss")  # a loop's value before this stage's layers
            self._check_terms(loss, produced)
            if loss is not None and training:
                self._saved[microbatch] = (leaves, loss)
            return None
        if self.is_first:
            captured: list[Any] = []

            def capture(argument: Any) -> Any:
                captured.append(module.run_stage(argument, (), recompute, params))
                raise StageExit

            with suppress(StageExit):
                self._run_step(step, microbatch % num_microbatches, capture, params)
            if not captured:
                raise RuntimeError(self._not_called())
            output, leaving = captured[0]
        else:
            output, leaving = module.run_stage(value, skips, recompute, params)
        tensors_out, was_tuple_out = as_tuple(output)
        tensors_out = (*tensors_out, *leaving)
        if training:
            self._saved[microbatch] = (leaves, tensors_out)
        return tensors_out, Packing(was_tuple_out)

    def _forward_blocks(
        self,
        microbatch: int,
        num_microbatches: int,
        received: Received | None,
        leaves: list[Tensor],
        recompute: bool,
        params: dict[str, Tensor] | None,
        step: StepFn | None,
    ) -> Sent | None:
        """A block container's stage: the user's step runs here too, its loop over the blocks
        skipping other stages' blocks, starting this stage's on ``received`` and, on every stage but
        the last, ending at the next stage's first block (see :mod:`lightning_pipe.runtime.blocks.container`).
        The values recorded by earlier blocks and received (after the hidden state) go to the model's
        recording in those blocks' place, and are sent on with this stage's own."""
        assert isinstance(self.module, BlockStage)
        codes, shape = split_codes(received[2].recorded if received is not None else (), self.module.bounds[0])
        at = len(leaves) - Returned.count(shape)  # the returned values (T5's position biases) come last
        hidden, carried = Carry.split(leaves[:at], codes)
        value = None if received is None else from_tuple(tuple(hidden), received[2].was_tuple)
        carry = Carry(self.module.bounds[0], carried)
        returned = Returned.received(shape, leaves[at:])
        drive = BlockDrive(
            self.module.bounds, value, not self.is_last, recompute, params, carry, self.carry_refusal, returned
        )
        loss = None
        try:
            loss = self._run_step(step, microbatch % num_microbatches, drive, params)
        except StageExit:
            pass
        except Exception as error:  # a loop that expected more than the hidden state from another stage's block
            explained = None if drive.entered else drive.outputs.explain(error)
            if explained is None:
                raise
            raise explained from error
        drive.check(self.is_last)
        training = torch.is_grad_enabled()
        if self.is_last:
            refuse_held(loss, "The step's loss")
            self._check_terms(loss, drive.produced)
            if loss is not None and training:
                self._saved[microbatch] = (leaves, loss)
            return None
        hidden_out, was_tuple_out = as_tuple(drive.captured)
        tensors_out, counts = carry.outgoing(hidden_out, self.module.bounds[1])
        if counts and self.carry_refusal is not None:
            where = f"stage {self.stage}'s blocks record them for a later stage"
            raise HeldBlockRead(carrying_refused(carry.keys(), self.carry_refusal, where))
        if counts and not self._told_crossing:  # decided by the first micro-batch that records
            self._told_crossing = True
            self.tell(crossing_line(self.stage, tensors_out, counts))
        if drive.returned_out.tensors and not self._told_returned:
            self._told_returned = True
            self.tell(drive.returned_out.line(self.stage, self.module.bounds[1]))
        if drive.returned_out.codes():  # after the recorded values' codes, one for each earlier block and key
            counts = (*(counts or (1,) * self.module.bounds[1] * len(CARRIED_KEYS)), *drive.returned_out.codes())
            tensors_out = [*tensors_out, *drive.returned_out.tensors]
        if training:
            self._saved[microbatch] = (leaves, tuple(tensors_out))
        return tuple(tensors_out), Packing(was_tuple_out, counts)

    def holds(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s forward has run and its backward has not."""
        return microbatch in self._saved

    def output_grad_like(self, microbatch: int) -> list[Tensor]:
        """The outputs of ``microbatch`` whose gradient the next stage sends back (not the skip connections')."""
        _, outputs = self._saved[microbatch]
        return [t for t in outputs[: len(outputs) - self._stashed()] if t.requires_grad]

    def skip_outputs(self, microbatch: int) -> list[Tensor]:
        """What ``microbatch`` stashed for later stages (after its output, in ``skips_out``'s order), whose
        gradients those stages send back."""
        _, outputs = self._saved[microbatch]
        return list(outputs[len(outputs) - self._stashed() :])

    def _stashed(self) -> int:
        return len(getattr(self.module, "skips_out", ()))

    def backward(self, microbatch: int, grads: list[Tensor] | None) -> list[Tensor] | None:
        """Backward of ``microbatch``; returns the gradients to send to the previous stage."""
        leaves, outputs = self._saved.pop(microbatch)
        if self.trace is not None:
            self._backward_of = microbatch
        if self.offload is not None:  # its copies back now, if they did not come back ahead
            self.offload.prefetch(microbatch)
            self.offload.release(microbatch)
        if self.is_last:
            outputs.backward()
        else:
            needing = [t for t in outputs if t.requires_grad]
            if needing:
                torch.autograd.backward(needing, grads)
        if self.versions is not None and microbatch % self._microbatches == self._microbatches - 1:
            batch = microbatch // self._microbatches  # backwards run in order: the batch is complete
            self.completed[batch] = self.versions.gradient(batch)
        if self.offload is not None:  # the next offloaded micro-batch's copies come back while the stage works on
            self.offload.prefetch_next(microbatch)
        if self.is_first:
            return None
        return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves if leaf.requires_grad]

    def backward_input(self, microbatch: int, grads: list[Tensor] | None) -> list[Tensor] | None:
        """B of a split backward: the whole backward except the weight-gradient products that the
        stage's layers defer (see :mod:`lightning_pipe.runtime.grads.weight_store`), kept for W."""
        with weight_store.deferring() as works:
            input_grads = self.backward(microbatch, grads)
        self._weights_due[microbatch] = works
        return input_grads

    def backward_weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients B deferred, accumulated into ``.grad``."""
        weight_store.run(self._weights_due.pop(microbatch))

    def _run_step(
        self, step: StepFn | None, microbatch: int, hook: Any, params: dict[str, Tensor] | None = None
    ) -> Tensor | None:
        """The user's step for ``microbatch``, its call of the host going to ``hook``; with ``params`` (a
        weight version) the parameters outside the split layers run on the version's tensors too."""
        if step is None:
            raise RuntimeError(f"stage {self.stage} needs the user's step to run but none was given")
        if isinstance(self.host, BlockStage):
            routing: AbstractContextManager[SequentialLoop | None] = self.host.routed(hook)
        else:
            routing = self.host.routed(hook, self.module.span if isinstance(self.module, StageModule) else None)
        with routing as loop:
            if params is None or self.model is None or not self.outside:
                loss = step(microbatch)
            else:
                loss = on_version(self.model, {n: params[n] for n in self.outside}, step, microbatch)
            if isinstance(loop, SequentialLoop):
                loop.check()
            return loss

    def _check_terms(self, loss: Tensor | None, produced: Sequence[Tensor]) -> None:
        """The first training micro-batch's loss on the last stage: no term over the layers' parameters
        outside the pipelined call (:mod:`lightning_pipe.runtime.around.loss_terms`)."""
        if self._terms_checked or loss is None or not torch.is_grad_enabled() or not isinstance(loss, Tensor):
            return
        self._terms_checked = True
        prefix = f"{self.module.path}." if self.module.path else ""
        named = [(prefix + name, p) for name, p in self.host.named_parameters()]
        refuse_parameter_terms(loss, produced, named)

    def _not_called(self) -> str:
        return (
            "The step never called the pipelined Sequential. Under the pipeline the step must compute its output "
            "with self(...) (or the Sequential itself), once per batch."
        )
