"""The one-process references of the asynchronous rules that run on other weights than the stashed
forward's (PipeMare, XPipe), for any model whose blocks are split into stages: an ``nn.Sequential``,
a Hugging Face model's block container with its embeddings, final norm and head outside the split.

The model runs whole, in one process, through :func:`torch.func.functional_call` on the weights the
rule gives each forward; a forward hook on the last block of each stage cuts the graph there (the
hidden state goes on as a fresh leaf), so each stage's backward of a micro-batch runs on its own, in
the step the schedule runs it (:func:`backward_gap`; the last step of an epoch drains every backward
owed before its update), and reads, where autograd saved a weight, the weights the rule gives that
backward. The activations
saved by the forward are the forward's. A parameter belongs to the stage whose part of the graph uses
it (the embeddings to the first, a final norm and head to the last), found from the graph itself; a
parameter used by two stages has no single delay and is refused. At the end of step ``t`` stage
``s``'s gradient of batch ``t - tau_s`` (``tau_s``: :func:`update_delay`) is applied by the model's
own optimizer with ``lr * lr_factor(tau_s, t, K)`` (PipeMare's learning-rate rescheduling; ``K = 0``:
off); a stage with no gradient due yet steps nothing.

- PipeMare: forwards on the current weights ``W_s(t)``; a backward ``gap`` updates after its forward
  on ``W_s - gap * delta_s`` with discrepancy correction (else on ``W_s``), the velocity following
  every update: ``delta_s <- gamma_s * delta_s + (1 - gamma_s) * (W_s(t+1) - W_s(t))``,
  ``gamma_s = velocity_decay(tau_s, D)``.
- XPipe: forwards on ``P(W_s(t), tau_s)``, the weights predicted ``tau_s`` updates ahead; a backward
  ``gap > 0`` updates after its forward on ``P(W_s(t + gap), tau_s - gap)``, at ``gap = 0`` on the
  forward's prediction. ``P``: the last update repeated (``"update"``), Adam's bias-corrected
  direction (``"adam"``) or SGD's momentum buffer (``"momentum"``), read from the optimizer's state.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.runtime.asynchronous.pipemare import DEFAULT_DECAY, lr_factor, velocity_decay
from lightning_pipe.runtime.asynchronous.xpipe import predict_adam, predict_from_update, predict_momentum
from lightning_pipe.schedules import update_delay
from lightning_pipe.schedules.families.asynchronous import backward_gap

#: the loss of one micro-batch: ``loss(module, inputs, targets)``, a mean over the micro-batch
Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def cross_entropy(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The loss of the tests' classifiers (``TinyNet``, ``WrappedNet``)."""
    return torch.nn.functional.cross_entropy(module(x), y)


def own_loss(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """A Hugging Face model's own loss (``HFModule``)."""
    return module(x, y).loss


@dataclass(frozen=True)
class Rule:
    """``schedule``: "pipemare" or "xpipe"; ``warmup``: PipeMare's ``K`` (0: no rescheduling);
    ``correction`` and ``decay`` (``D``): PipeMare's discrepancy correction; ``predictor``: XPipe's."""

    schedule: str
    warmup: int = 0
    correction: bool = True
    decay: float = DEFAULT_DECAY
    predictor: str = "update"

    def __post_init__(self) -> None:
        if self.schedule not in ("pipemare", "xpipe"):
            raise ValueError(f"no reference here for schedule={self.schedule!r}: pipemare or xpipe")


@dataclass(frozen=True)
class _Weight:
    """A weight (or a view of it) that autograd saved in batch ``batch``'s forward."""

    name: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt
    batch: int


@dataclass
class _Forward:
    """One micro-batch's forward: the weights it ran on (leaves), each stage's output (the last
    stage's: its scaled loss) and input (a leaf; None on the first stage)."""

    leaves: dict[str, Tensor]
    outs: list[Tensor] = field(default_factory=list)
    ins: list[Tensor | None] = field(default_factory=lambda: [None])


class _Caller(nn.Module):
    """The loss as a module, so that :func:`torch.func.functional_call` runs it on given weights."""

    def __init__(self, module: nn.Module, loss: Loss) -> None:
        super().__init__()
        self.model = module
        self.loss = loss

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.loss(self.model, x, y)


class _Reference:
    """One run of ``rule`` (see the module docstring): the model's own parameters are the current
    weights ``W``, stepped by the model's own optimizer; ``delta`` is PipeMare's velocity or XPipe's
    last update."""

    def __init__(
        self,
        module: nn.Module,
        blocks: nn.Module,
        balance: Sequence[int],
        chunks: int,
        loss: Loss,
        rule: Rule,
    ) -> None:
        self.rule = rule
        self.chunks = chunks
        self.stages = len(balance)
        self.caller = _Caller(module, loss)
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.optimizer = module.configure_optimizers()  # type: ignore[operator]
        self.group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        self.tau = [update_delay(rule.schedule, self.stages, chunks, s) for s in range(self.stages)]
        self.gamma = [0.0 if rule.schedule == "xpipe" else velocity_decay(t, rule.decay) for t in self.tau]
        self.delta = {n: torch.zeros_like(p) for n, p in self.params.items()}  # XPipe: the last update
        self.recording: _Forward | None = None  # the forward running now
        self.now = 0  # the step whose backwards run
        self.ahead: dict[str, Tensor] = {}  # the weights this step's forwards ran on
        ends = list(accumulate(balance))[:-1]
        self.handles = [blocks[end - 1].register_forward_hook(self._cut) for end in ends]  # type: ignore[index]
        self.stage_of: dict[str, int] = {}

    # ------------------------------------------------------------------ cutting the graph into stages
    def _cut(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The stage's output is kept; the next stage starts from a fresh leaf of the same value."""
        if self.recording is None:
            return None
        hidden = output if isinstance(output, Tensor) else output[0]
        leaf = hidden.detach().requires_grad_()
        self.recording.outs.append(hidden)
        self.recording.ins.append(leaf)
        return leaf if isinstance(output, Tensor) else (leaf, *output[1:])

    def _run(self, weights: dict[str, Tensor], x: Tensor, y: Tensor, scale: float, batch: int) -> _Forward:
        """One micro-batch's forward on ``weights`` (leaves), with its saved weights recorded as such."""
        by_storage = {w.untyped_storage().data_ptr(): n for n, w in weights.items()}

        def pack(tensor: Tensor) -> Any:
            try:
                name = by_storage.get(tensor.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                return tensor
            if name is None or tensor.dtype != weights[name].dtype:
                return tensor
            return _Weight(name, tensor.size(), tensor.stride(), tensor.storage_offset(), batch)

        def unpack(saved: Any) -> Any:
            if not isinstance(saved, _Weight):
                return saved
            base = self.backward_weight(saved.name, saved.batch).contiguous()
            return base.as_strided(saved.size, saved.stride, saved.offset)

        self.recording = _Forward(weights)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                named = {f"model.{n}": w for n, w in weights.items()}
                loss = torch.func.functional_call(self.caller, named, (x, y), strict=False)
            self.recording.outs.append(loss * scale)
            assert len(self.recording.outs) == self.stages, "a stage's last block did not run"
            return self.recording
        finally:
            self.recording = None

    def find_stages(self, x: Tensor, y: Tensor) -> None:
        """Each parameter's stage: the one whose part of the graph reaches it."""
        leaves = {
            n: p.detach().clone(memory_format=torch.contiguous_format).requires_grad_() for n, p in self.params.items()
        }
        run = self._run(leaves, x, y, 1.0, -1)
        names = list(leaves)
        for s, out in enumerate(run.outs):
            grads = torch.autograd.grad(out.sum(), list(leaves.values()), allow_unused=True, retain_graph=True)
            for name, grad in zip(names, grads):
                if grad is None:
                    continue
                if name in self.stage_of:
                    raise ValueError(
                        f"{name} is used on stages {self.stage_of[name]} and {s}, whose delays differ: "
                        "the rule gives it no single delay"
                    )
                self.stage_of[name] = s

    # ------------------------------------------------------------------ the weights the rule gives
    def predicted(self, name: str, steps: int) -> Tensor:
        """XPipe's prediction of ``name`` ``steps`` updates ahead from the weights now."""
        p = self.params[name]
        w = p.detach()
        if steps <= 0:
            return w
        if self.rule.predictor == "update":
            return predict_from_update(w, self.delta[name], steps)
        state, group = self.optimizer.state.get(p), self.group_of[id(p)]
        if not state:
            return w  # no update yet
        if self.rule.predictor == "adam":
            betas, k = group["betas"], int(state["step"])
            return predict_adam(w, state["exp_avg"], state["exp_avg_sq"], k, group["lr"], betas, group["eps"], steps)
        return predict_momentum(w, state["momentum_buffer"], group["lr"], steps)

    def forward_weights(self) -> dict[str, Tensor]:
        """The weights this step's forwards run on: PipeMare's current ones, XPipe's predicted ones."""
        if self.rule.schedule == "pipemare":
            return {n: p.detach().clone() for n, p in self.params.items()}
        return {n: self.predicted(n, self.tau[self.stage_of.get(n, 0)]).clone() for n in self.params}

    def backward_weight(self, name: str, batch: int) -> Tensor:
        """The weight ``name`` for the backward of batch ``batch`` in step ``self.now``."""
        gap = self.now - batch
        if batch < 0:  # finding the stages
            return self.params[name].detach()
        if gap == 0:  # no update since the forward
            return self.ahead[name]
        w = self.params[name].detach()
        if self.rule.schedule == "pipemare":
            return w - gap * self.delta[name] if self.rule.correction else w
        return self.predicted(name, self.tau[self.stage_of[name]] - gap)

    # ------------------------------------------------------------------ the update
    def update(self, stage: int, step: int, grads: dict[str, Tensor] | None) -> None:
        """Stage ``stage``'s update at the end of step ``step`` with ``grads`` (None: none due)."""
        mine = [n for n in self.params if self.stage_of.get(n) == stage]
        before = {n: self.params[n].detach().clone() for n in mine}
        for n, p in self.params.items():
            p.grad = grads.get(n) if grads is not None and n in mine else None
        factor = lr_factor(self.tau[stage], step, self.rule.warmup)
        users = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * factor
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, users):
            g["lr"] = lr
        gamma = self.gamma[stage]
        for n in mine:
            self.delta[n] = gamma * self.delta[n] + (1 - gamma) * (self.params[n].detach() - before[n])
        for p in self.params.values():
            p.grad = None

    # ------------------------------------------------------------------ the steps
    def train(self, batches: Sequence[tuple[Tensor, Tensor]], ends: Collection[int]) -> None:
        """One step per batch: its forwards, the backwards due (the later stage's first), the updates.
        At the end of the steps ``ends`` and of the last one, every backward owed runs before the update."""
        x0, y0 = batches[0]
        self.find_stages(x0.chunk(self.chunks)[0], y0.chunk(self.chunks)[0])
        drains = sorted({*ends, len(batches) - 1})
        runs: dict[tuple[int, int], _Forward] = {}
        dy: dict[tuple[int, int], Tensor] = {}
        grads: dict[tuple[int, int], dict[str, Tensor]] = {}  # (batch, stage) -> summed over its micro-batches
        for t, (x, y) in enumerate(batches):
            self.now = t
            self.ahead = self.forward_weights()
            leaves = {
                n: w.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
                for n, w in self.ahead.items()
            }
            for i, (xi, yi) in enumerate(zip(x.chunk(self.chunks), y.chunk(self.chunks))):
                runs[(t, i)] = self._run(leaves, xi, yi, len(xi) / len(x), t)
            for s in reversed(range(self.stages)):  # this step's backwards: the later stage's first
                for (b, i), run in list(runs.items()):
                    drain = next(d for d in drains if d >= b)
                    if min(b + backward_gap(self.stages, self.chunks, s, i), drain) != t:
                        continue
                    self._backward(run, s, (b, i), dy, grads.setdefault((b, s), {}))
                    if s == 0:
                        del runs[(b, i)]
            for s in range(self.stages):  # the update at the end of step t
                self.update(s, t, grads.pop((t - self.tau[s], s), None))

    def close(self) -> None:
        """Takes the cutting hooks off the blocks."""
        for handle in self.handles:
            handle.remove()

    def _backward(
        self, run: _Forward, s: int, key: tuple[int, int], dy: dict[tuple[int, int], Tensor], into: dict[str, Tensor]
    ) -> None:
        """Stage ``s``'s backward of micro-batch ``key``: its weight gradients are added to ``into``, its
        input gradient is left in ``dy`` for the stage before."""
        leaves = run.leaves
        mine = [n for n in leaves if self.stage_of.get(n) == s]
        inputs = [leaves[n] for n in mine] + ([run.ins[s]] if s > 0 else [])
        out, upstream = run.outs[s], (None if s == self.stages - 1 else dy.pop(key))
        got = torch.autograd.grad(out, inputs, upstream, allow_unused=True)  # type: ignore[arg-type]
        for n, g in zip(mine, got):
            if g is not None:
                into[n] = g if n not in into else into[n] + g
        if s > 0:
            dy[key] = got[-1]


def reference(
    module: nn.Module,
    blocks: nn.Module,
    balance: Sequence[int],
    batches: Sequence[tuple[Tensor, Tensor]],
    chunks: int,
    loss: Loss,
    rule: Rule,
    ends: Collection[int] = (),
) -> None:
    """Train ``module`` in place, in one process, by ``rule`` on ``batches`` (one step each), its
    ``blocks`` split into stages of ``balance[s]`` blocks and each batch into ``chunks`` micro-batches;
    ``ends``: the steps (from 0) that end an epoch, where the pipeline drains before the update."""
    run = _Reference(module, blocks, balance, chunks, loss, rule)
    try:
        run.train(batches, ends)
    finally:
        run.close()
