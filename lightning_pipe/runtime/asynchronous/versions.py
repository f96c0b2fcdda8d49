"""Weight versions of one stage for asynchronous schedules (PipeDream's weight stashing).

A batch's forwards run on a version of the stage's parameters taken when the batch starts: tensors
that share the parameters' memory but not their autograd identity, so the batch's backwards go
through the very tensors its forwards used and their gradients accumulate there. Versions are
copy-on-write: only when the optimizer is about to change the parameters in place while a
version still needs the old values (:meth:`WeightVersions.protect`) do the parameters move to a
fresh copy, leaving the old memory to the version. A stage thus holds two weight copies in the
steady state (PipeDream-2BW's "2 buffered weights"), and one where no backward is in flight
across an update (the last stage). A version is dropped as soon as its batch's last backward on
this stage is done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call


def stage_parameters(module: nn.Module, outside: Mapping[str, nn.Parameter] | None = None) -> dict[str, nn.Parameter]:
    """A stage's parameters by name: its layers' (their names in ``module``) and the trainable ones
    outside the split layers that this rank holds (``outside``: their names in the user's model, which
    never begin with a digit as a stage module's do)."""
    named = dict(module.named_parameters())
    clash = [n for n in outside or {} if n in named]
    if clash:
        raise ValueError(f"parameters outside the split layers named as the stage's own: {clash[:4]}")
    return {**named, **(outside or {})}


class _Step(nn.Module):
    """Holds the user's model so that :func:`torch.func.functional_call` can swap its parameters for
    one call of the step."""

    def __init__(self, model: nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.run = run

    def forward(self, *args: Any) -> Any:
        return self.run(*args)


def on_version(model: nn.Module, tensors: Mapping[str, Tensor], run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)`` (the user's step) with ``model``'s parameters named in ``tensors`` replaced by
    those tensors (a weight version's) for the call, their ties too."""
    if not tensors:
        return run(*args)
    swapped = {f"model.{name}": t for name, t in tensors.items()}
    return functional_call(_Step(model, run), swapped, args, strict=False, tie_weights=True)


class WeightVersions:
    """Snapshots of a module's parameters (and ``outside``: see :func:`stage_parameters`), keyed by
    version (the batch index)."""

    def __init__(
        self,
        module: nn.Module,
        on_gradient: Callable[[int, str], None] | None = None,
        outside: Mapping[str, nn.Parameter] | None = None,
    ) -> None:
        self.module = module
        self.named = stage_parameters(module, outside)
        self._versions: dict[int, dict[str, Tensor]] = {}
        self.on_gradient = on_gradient  # instrumentation: called with (version, name) as gradients arrive
        self.peak_bytes = 0
        self.peak_weight_bytes = 0  # stashed weights alone (no gradients): the weight copies beyond the parameters

    def create(self, version: int, source: Mapping[str, Tensor] | None = None) -> None:
        """Take the current parameters as ``version`` (no copy yet); with ``source`` (by parameter
        name), the tensors there instead (XPipe's predicted weights)."""
        snapshot: dict[str, Tensor] = {}
        for name, param in self.named.items():
            held = param if source is None else source.get(name, param)
            alias = torch.empty(0, dtype=held.dtype, device=held.device)
            alias.set_(held.untyped_storage(), held.storage_offset(), held.size(), held.stride())
            alias.requires_grad_(param.requires_grad)
            if self.on_gradient is not None and alias.requires_grad:
                alias.register_hook(self._hook(version, name))
            snapshot[name] = alias
        self._versions[version] = snapshot
        self._note_peak()

    def protect(self) -> None:
        """Before an in-place update of the parameters: move every parameter whose memory a held
        version uses to a copy, so the version keeps the values its forwards saw."""
        shared = {t.untyped_storage().data_ptr() for snapshot in self._versions.values() for t in snapshot.values()}
        with torch.no_grad():
            for param in self.named.values():
                if param.untyped_storage().data_ptr() in shared:
                    param.data = param.data.clone()
        self._note_peak()

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        self.peak_weight_bytes = max(self.peak_weight_bytes, self.nbytes(gradients=False))

    def _hook(self, version: int, name: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            assert self.on_gradient is not None
            self.on_gradient(version, name)

        return hook

    def params(self, version: int) -> dict[str, Tensor]:
        return self._versions[version]

    def gradient(self, version: int) -> dict[str, Tensor | None]:
        """The gradient accumulated on ``version``; drops the version."""
        self._note_peak()
        snapshot = self._versions.pop(version)
        return {name: t.grad for name, t in snapshot.items()}

    def held(self) -> list[int]:
        return sorted(self._versions)

    def nbytes(self, gradients: bool = True) -> int:
        """Bytes held for versions beyond the parameters themselves: stashed weights whose memory
        the parameters no longer use, and (``gradients``) the gradients accumulated on versions."""
        current = {p.untyped_storage().data_ptr() for p in self.named.values()}
        counted: set[int] = set()
        total = 0
        for snapshot in self._versions.values():
            for t in snapshot.values():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in current and ptr not in counted:
                    counted.add(ptr)
                    total += t.untyped_storage().nbytes()
                if gradients and t.grad is not None:
                    total += t.grad.numel() * t.grad.element_size()
        return total

    def clear(self) -> None:
        self._versions.clear()
