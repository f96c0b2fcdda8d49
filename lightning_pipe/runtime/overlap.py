"""Running an overlapped unit (DualPipe's F&B): one micro-batch's forward beside another's backward.

The schedule posts every receive of a unit before its first compute, so nothing the unit waits for
lies between its forward and its backward. On a GPU the executor gives the two halves different
CUDA streams (the forward the one the backward's micro-batch did not use for its own forward,
since autograd runs a backward on its forward's stream), so their kernels can run at once; on a
CPU they run one after another and the overlap is the communication's: the backward's gradient
arrives while the forward computes, and the forward's output travels while the backward does.

A model can take over how the two halves run (for example to interleave their chunks by hand, as
DeepSeek's DualPipe lets a model do) by defining on its LightningModule::

    def overlapped_forward_backward(self, forward, backward):
        ...  # call forward() and backward(), each once

It is looked up on the module in every process, so it reaches processes that start apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``hook(forward, backward)``: runs an overlapped unit's two halves, each called exactly once
OverlapHook = Callable[[Callable[[], None], Callable[[], None]], None]

#: the name of the LightningModule method that replaces :func:`one_after_another`
HOOK_NAME = "overlapped_forward_backward"


def one_after_another(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """The default: the forward, then the backward (on a GPU their kernels, queued on two streams,
    still run at once)."""
    forward()
    backward()


def overlap_hook(module: Any) -> OverlapHook:
    """The module's ``overlapped_forward_backward`` where it defines one, else :func:`one_after_another`."""
    hook = getattr(module, HOOK_NAME, None)
    if hook is None:
        return one_after_another
    if not callable(hook):
        raise TypeError(
            f"{type(module).__name__}.{HOOK_NAME} = {hook!r}: define it as a method "
            "overlapped_forward_backward(self, forward, backward) that calls forward() and backward() once each."
        )
    return hook


def checked(hook: OverlapHook, forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """Run ``hook`` and refuse one that skips or repeats a half (the step would be wrong)."""
    calls = {"forward": 0, "backward": 0}

    def once(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            if calls[name]:
                raise RuntimeError(
                    f"{HOOK_NAME} called {name}() a second time; call forward() and backward() once each."
                )
            calls[name] += 1
            fn()

        return run

    hook(once("forward", forward), once("backward", backward))
    missing = [name for name, count in calls.items() if not count]
    if missing:
        raise RuntimeError(
            f"{HOOK_NAME} returned without calling {' and '.join(f'{m}()' for m in missing)}; "
            "call forward() and backward() once each."
        )
