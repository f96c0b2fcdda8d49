"""Block containers: pipelining a model whose ``forward`` loops over its repeated blocks.

A Hugging Face model (and most vision transformers) keeps its blocks in an ``nn.ModuleList`` and
runs them in its own ``forward``: ``for block in self.layers: hidden = block(hidden, mask=...,
position_embeddings=...)``. :class:`BlockStage` replaces that container, holding only this rank's
blocks under their original indices (so parameter names do not change), and the model's
``forward`` runs unchanged on *every* stage, once per micro-batch:

- what runs before the first block (embeddings, rotary tables, masks) runs on every stage, so
  every block gets the keyword arguments it would get in the unsplit model, computed locally from
  the micro-batch that every stage loads anyway;
- blocks held by earlier stages are skipped (the loop sees a stand-in that hands its hidden state
  on unchanged), and the first block of this stage receives, instead of that hidden state, the
  activation the previous stage sent;
- on a stage that is not the last, the loop reaches the first block of the next stage, which
  takes the hidden state it is called with (what crosses the boundary) and ends the step there;
- on the last stage the loop runs to its end, and what follows (final norm, head, loss) runs too.

What crosses a stage boundary is the first argument a block is called with (the hidden state: a
tensor or a tuple of tensors) and, under the chain schedules, what the last block before the
boundary returns beside it that the next block is called with (T5's position biases:
:class:`~lightning_pipe.runtime.crossing.carried.Returned`; the stand-ins of earlier blocks on the next
stages return it in the block's structure). The rest of a block's arguments must be recomputable
from the micro-batch on every stage (see the README's "Bring your own model"). A model that reads another stage's
block's output is refused (:mod:`lightning_pipe.runtime.blocks.reads`), except for what a Hugging Face
model records of its blocks with hooks (router logits for an MoE load-balancing loss, hidden states,
attention weights), which travels with the micro-batch beside the hidden state
(:mod:`lightning_pipe.runtime.crossing.carried`).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_pipe.runtime.activations.recomputation import keep_buffers
from lightning_pipe.runtime.blocks.nested import nested_like, padded_for_crossing
from lightning_pipe.runtime.blocks.outputs import BlockOutputs, argument_names
from lightning_pipe.runtime.blocks.reads import (
    HeldBlockRead,
    held,
    hf_recording,
    refuse_held,
    refuse_recorded_outputs,
    tensors_in,
)
from lightning_pipe.runtime.crossing.carried import Carry, Returned, carried_recording, carrying_refused
from lightning_pipe.runtime.crossing.forced_outputs import only_forced
from lightning_pipe.torch_internals import child_slot, filled_slots, meta_copy, nested_from_mask_shapes


class StageExit(BaseException):
    """Ends the user's step on a stage once its layers ran. A BaseException so that a step's own
    ``except Exception`` cannot swallow it."""


def hidden_argument(block: nn.Module) -> str:
    """The name of the first parameter of ``block``'s ``forward`` (the hidden state), for blocks
    that are called with it as a keyword."""
    params = [p for p in inspect.signature(block.forward).parameters.values() if p.kind not in (p.VAR_KEYWORD,)]
    return params[0].name if params else "hidden_states"


def plain_attributes(block: nn.Module) -> dict[str, Any]:
    """The public attributes of ``block`` outside its tensors and modules (``attention_type``, ``layer_idx``),
    which code around the steps may read from blocks held by other stages
    (:class:`~lightning_pipe.runtime.around.held_layers.HeldLayer`)."""
    return {k: v for k, v in vars(block).items() if not k.startswith("_")}


class BlockShell:
    """What remains on this rank of a block held by another stage: the name of its hidden-state
    argument, and its structure to read, as a copy with its tensors on the meta device (the
    ``shadow``: same classes, same configuration, no memory). A model's loop may read another stage's
    block before it runs its own: torch's ``nn.TransformerEncoder`` reads ``self.layers[0].self_attn
    .batch_first``, its layers' training mode and whether their weights need a gradient to choose its
    fast path, and so takes the path here that it takes in plain training. A read of a tensor gives its
    meta copy (its shape, dtype and ``requires_grad``, no values)."""

    def __init__(self, block: nn.Module) -> None:
        self.hidden = hidden_argument(block)
        self.kind = type(block).__name__
        self.arguments = argument_names(block)
        self.shadow = meta_copy(block)


def held_stages(held: tuple[tuple[int, ...], int]) -> str:
    """How an error names the stages a process's module holds, ``((0, 2), 4)``: ``pipeline stages 0 and 2 of
    4``. The count is the split's, as the layout line gives it (Chimera's copies run the same split stages)."""
    stages, of = held
    if len(stages) == 1:
        return f"pipeline stage {stages[0]} of {of}"
    return f"pipeline stages {', '.join(map(str, stages[:-1]))} and {stages[-1]} of {of}"


class LoopedContainer(nn.Module, ABC):
    """What a model's loop over its blocks needs of the container standing in for its
    ``nn.ModuleList``: a length, iteration, indexing and slicing, each index answered by
    :meth:`entry`."""

    @abstractmethod
    def __len__(self) -> int:
        """How many blocks the model's loop sees."""

    @abstractmethod
    def entry(self, index: int) -> Any:
        """What the loop gets at ``index``."""

    def __iter__(self) -> Iterator[Any]:
        return (self.entry(i) for i in range(len(self)))

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self.entry(i) for i in range(len(self))[index]]
        return self.entry(range(len(self))[index])


def layer_parameter_names(layers: Mapping[str, nn.Module]) -> dict[str, list[tuple[str, str]]]:
    """Per layer key: (name in the holding module, name inside the layer) of each of its parameters,
    to run a layer on a weight version given by the holding module's names."""
    return {key: [(f"{key}.{name}", name) for name, _ in layer.named_parameters()] for key, layer in layers.items()}


class BlockStage(LoopedContainer):
    """The blocks of one or more stages of a block container, keyed by their index in it.

    ``shells``: for every index of the unsplit container, the :class:`BlockShell` of its block, so
    that the loop sees the container's full length and every block's plain attributes.
    """

    runs_whole_step = True  # every stage runs the user's step (see the module docstring)
    modifies_input = False

    def __init__(
        self,
        blocks: OrderedDict[str, nn.Module],
        stage: int,
        num_stages: int,
        shells: list[BlockShell],
        stand_ins: Sequence[nn.Module] = (),
    ) -> None:
        super().__init__()
        for key, block in blocks.items():
            self.add_module(key, block)
        self.stage = stage
        self.num_stages = num_stages
        #: the split stages this module holds and their count, for errors (see :func:`held_stages`)
        self.held: tuple[tuple[int, ...], int] = ((stage,), num_stages)
        self._shells = shells
        #: per index, what code outside the steps gets for a block another stage holds (a module without
        #: tensors, :class:`~lightning_pipe.runtime.around.held_layers.HeldLayer`); kept out of the module's children
        self._stand_ins = list(stand_ins)
        indices = [int(k) for k in blocks]
        self.bounds = (min(indices), max(indices) + 1) if indices else (0, 0)
        self.hook: BlockDrive | None = None
        self._param_names = layer_parameter_names(filled_slots(self))
        #: the container's path in the model (``"model.layers"``), for messages
        self.path = ""

    def __len__(self) -> int:
        return len(self._shells)

    def train(self, mode: bool = True) -> BlockStage:
        """The blocks held here and the shadows of those held elsewhere take the mode, which a model's
        loop may read from any of them (``self.layers[0].training``)."""
        for shell in self._shells:
            shell.shadow.train(mode)
        return super().train(mode)

    @contextmanager
    def routed(self, drive: BlockDrive) -> Iterator[None]:
        """While the user's step runs: its loop over the container goes through ``drive`` (the
        stage's part of the micro-batch), the model's code unchanged; the padded shapes of the nested
        tensors the forward builds from a mask are noted for what crosses
        (:mod:`~lightning_pipe.runtime.blocks.nested`)."""
        self.hook = drive
        try:
            with nested_from_mask_shapes(drive.nested_shapes):
                yield
        finally:
            self.hook = None

    def entry(self, i: int) -> Any:
        if self.hook is not None:
            return self.hook.entry(self, i)
        held = child_slot(self, str(i))
        if held is not None:
            return held
        if self._stand_ins:  # outside the steps (configure_optimizers, a callback): its structure, no tensors
            return self._stand_ins[i]
        raise RuntimeError(
            f"This module holds {held_stages(self.held)} (blocks "
            f"{self.bounds[0]}..{self.bounds[1] - 1}); it runs inside the Trainer's steps. To use the whole model "
            "outside the Trainer, load a consolidated checkpoint."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "The pipelined block container was called as a module; a block container is iterated by the model's "
            "forward (for block in self.layers: ...). To split an nn.Sequential that forward calls, give its path "
            "to PipelineStrategy(module=...) as an nn.Sequential."
        )

    def block(self, index: int) -> nn.Module | None:
        """The block at ``index`` of the unsplit container, if this rank holds it."""
        return child_slot(self, str(index))

    def shell(self, index: int) -> BlockShell:
        return self._shells[index]

    def own_params(self, index: int, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The entries of ``params`` (names as in this module's ``named_parameters``) that belong to the
        block at ``index``, under their names inside the block."""
        return {inner: params[full] for full, inner in self._param_names[str(index)]}


class BlockDrive:
    """One micro-batch's pass through the loop over the blocks, on one stage.

    Args:
        bounds: the stage's blocks, ``start`` to ``stop`` (exclusive) in the unsplit container.
        received: the hidden state from the previous stage (None on the first stage).
        stops: whether the pass ends at block ``stop`` (every stage but the last).
        recompute: recompute each block in the backward.
        params: the weight version to run on (asynchronous schedules), by the host's names.
        carry: the recorded values received for earlier blocks and recorded by this stage's.
        refusal: why this run cannot carry recorded values (the schedule), None where it can.
        returned: what the previous stage's last block returned for later blocks (T5's position biases).
    """

    def __init__(
        self,
        bounds: tuple[int, int],
        received: Any,
        stops: bool,
        recompute: bool,
        params: dict[str, Tensor] | None,
        carry: Carry | None = None,
        refusal: str | None = None,
        returned: Returned | None = None,
    ) -> None:
        self.start, self.stop = bounds
        self.received = received
        self.stops = stops
        self.recompute = recompute
        self.params = params
        self.entered = False
        self.captured: Any | None = None
        self.finished = False
        self.outputs = BlockOutputs()  # what blocks return beside their hidden state (refused at a boundary)
        self.carry = carry if carry is not None else Carry(self.start, None)
        self.refusal = refusal
        #: values the previous stage's last block returned for later blocks, and this stage's
        self.returned_in = returned if returned is not None else Returned()
        self.returned_out = Returned()
        self.last_output: Any = None
        #: the tensors this stage's blocks returned (what the step's loss may reach their parameters through)
        self.produced: list[Tensor] = []
        #: the padded shapes the forward built nested tensors from (torch's encoder in evaluation)
        self.nested_shapes: list[tuple[int, ...]] = []

    def entry(self, host: BlockStage, index: int) -> Any:
        if index < self.start:
            return _Skipped(host, index, self)
        if index < self.stop:
            return _Local(host, index, self)
        if self.stops and index == self.stop:
            return _Boundary(host, index, self)
        return _Skipped(host, index, self)

    def check(self, is_last: bool) -> None:
        """After the step: the loop reached this stage's blocks (and, on a stage that hands on, the
        next stage's first block) exactly as the unsplit model would."""
        if not self.entered:
            raise RuntimeError(
                f"The step never reached the pipelined blocks {self.start}..{self.stop - 1}. Under the pipeline the "
                "model's forward must run its blocks in order, once per micro-batch, in the step."
            )
        if not is_last and not self.finished:
            raise RuntimeError(
                f"The step ran blocks {self.start}..{self.stop - 1} but never called block {self.stop}, the next "
                "stage's "
                "first. Under the pipeline the model's forward must run all its blocks in order, once per micro-batch."
            )


class _Entry:
    """What the model's loop gets for one index of the container: proxies the block's attributes (its
    shadow's, where another stage holds it: :class:`BlockShell`)."""

    def __init__(self, host: BlockStage, index: int) -> None:
        self._host = host
        self._index = index

    def __getattr__(self, name: str) -> Any:
        block = self._host.block(self._index)
        return getattr(block if block is not None else self._host.shell(self._index).shadow, name)

    def _hidden(self, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        if args:
            return args[0], True
        name = self._host.shell(self._index).hidden
        if name not in kwargs:
            raise TypeError(
                f"Block {self._index} was called without its hidden state (no positional argument and no {name!r}); "
                "the pipeline passes the first argument of each block between stages."
            )
        return kwargs[name], False

    def _with_hidden(self, value: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, self._host.shell(self._index).hidden: value}


class _Skipped(_Entry):
    """A block of an earlier stage: hands its hidden state on (the next held block replaces it),
    as a :class:`~lightning_pipe.runtime.blocks.reads.HeldOutput`, so that a read of it is refused."""

    def __init__(self, host: BlockStage, index: int, drive: BlockDrive) -> None:
        super().__init__(host, index)
        self._drive = drive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._drive.outputs.skipped = (self._index, self._host.shell(self._index).kind)
        bounds = (self._drive.start, self._drive.stop)
        recording = hf_recording()
        carried = list(carried_recording())
        if carried:
            self._feed(bounds, carried)
            recording = [k for k in recording if k not in carried]
        if recording and not only_forced(recording):  # a recording nothing reads (Wav2Vec2's classifier) is no read
            refuse_recorded_outputs(self._index, bounds, recording)
        return self._drive.returned_in.standing_in(held(self._hidden(args, kwargs)[0], self._index, bounds))

    def _feed(self, bounds: tuple[int, int], keys: list[str]) -> None:
        """The model records values of its blocks that cross stages: give it those this block
        recorded on its stage."""
        drive = self._drive
        if drive.refusal is None and drive.carry.feed(self._index):
            return
        reason = drive.refusal or (
            "they were not received from the previous stage (this block runs on a later stage, or the earlier "
            "stages' forward did not record them)"
        )
        raise HeldBlockRead(
            carrying_refused(
                keys,
                reason,
                f"block {self._index} runs on another pipeline stage "
                f"(this stage runs only blocks {bounds[0]}..{bounds[1] - 1})",
            )
        )


class _Boundary(_Entry):
    """The next stage's first block: what it is called with crosses the boundary."""

    def __init__(self, host: BlockStage, index: int, drive: BlockDrive) -> None:
        super().__init__(host, index)
        self._drive = drive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._drive.entered:
            raise RuntimeError(f"The model's forward called block {self._index} before the blocks of this stage.")
        shell = self._host.shell(self._index)
        crossing = Returned.of(self._drive.last_output, args, kwargs) if self._drive.refusal is None else Returned()
        self._drive.returned_out = crossing
        self._drive.outputs.check_boundary(
            self._index, shell.kind, shell.arguments, args, kwargs, {id(t) for t in crossing.tensors}
        )
        captured = self._hidden(args, kwargs)[0]
        if isinstance(captured, Tensor) and captured.is_nested:  # torch's encoder in evaluation
            captured = padded_for_crossing(captured, self._drive.nested_shapes)
        self._drive.captured = captured
        refuse_held(self._drive.captured, f"What this stage sends on (block {self._index}'s hidden state)")
        self._drive.finished = True
        raise StageExit


class _Local(_Entry):
    """A block of this stage: runs, on the received hidden state if it is the stage's first."""

    def __init__(self, host: BlockStage, index: int, drive: BlockDrive) -> None:
        super().__init__(host, index)
        self._drive = drive

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        drive = self._drive
        if self._index == drive.start:
            if drive.entered:
                raise RuntimeError(
                    "The step ran the pipelined blocks twice for one micro-batch. Under the pipeline the step may run "
                    "the model's blocks once per micro-batch."
                )
            drive.entered = True
            if drive.received is not None:
                received = drive.received
                local = args[0] if args else kwargs.get(self._host.shell(self._index).hidden)
                if isinstance(local, Tensor) and local.is_nested and isinstance(received, Tensor):
                    received = nested_like(received, local)  # as this stage's encoder nested its input
                args, kwargs = self._with_hidden(received, args, kwargs)
        elif not drive.entered:
            raise RuntimeError(f"The model's forward called block {self._index} before block {drive.start}.")
        refuse_held((args, kwargs), f"What block {self._index} is called with")
        block = self._host.block(self._index)
        assert block is not None
        own = self._host.own_params(self._index, drive.params) if drive.params is not None else None

        def run(*a: Any, **k: Any) -> Any:
            return functional_call(block, own, a, k) if own else block(*a, **k)

        before = Carry.lengths()
        if not drive.recompute:
            output = run(*args, **kwargs)
        else:
            output = torch_checkpoint(
                run,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=lambda: keep_buffers(block),
                **kwargs,
            )
        drive.carry.record(self._index, before)
        drive.outputs.returned(self._index, output, args, kwargs)
        drive.last_output = output
        drive.produced.extend(tensors_in(output))  # and what the model recorded of the block (router logits)
        drive.produced.extend(tensors_in(drive.carry.own.get(self._index, {})))
        return output
