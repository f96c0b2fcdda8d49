"""lightning-pipe: pipeline model parallelism for PyTorch Lightning.

``import lightning_pipe`` registers ``Trainer(strategy="pipeline")`` and ``Fabric(strategy="pipeline")``: at
once where Lightning is imported already, else as soon as Lightning is (any ``Trainer`` or ``Fabric`` comes
after that). The package's
names (``PipelineStrategy``; ``build_pipeline`` for a plain PyTorch loop, without Lightning; ...) are
imported on first use (PEP 562), so that what needs neither Lightning nor torch, such as
``lightning-pipe --help``, does not spend seconds importing them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_pipe.assembly.build import build_pipeline
    from lightning_pipe.fabric.strategy import FabricPipelineStrategy
    from lightning_pipe.partition.stages.materialize import init_like_pipeline
    from lightning_pipe.penalties import parameter_penalty
    from lightning_pipe.runtime.crossing.records import recorded, recording
    from lightning_pipe.runtime.loss_weights import token_count
    from lightning_pipe.strategy import PipelineStrategy

__version__ = "0.1.0"

__all__ = [
    "FabricPipelineStrategy",
    "PipelineStrategy",
    "__version__",
    "build_pipeline",
    "init_like_pipeline",
    "parameter_penalty",
    "recorded",
    "recording",
    "token_count",
]

#: the package's names and the module each comes from, imported when first read
_EXPORTS = {
    "FabricPipelineStrategy": "lightning_pipe.fabric.strategy",
    "PipelineStrategy": "lightning_pipe.strategy",
    "build_pipeline": "lightning_pipe.assembly.build",
    "init_like_pipeline": "lightning_pipe.partition.stages.materialize",
    "parameter_penalty": "lightning_pipe.penalties",
    "recorded": "lightning_pipe.runtime.crossing.records",
    "recording": "lightning_pipe.runtime.crossing.records",
    "token_count": "lightning_pipe.runtime.loss_weights",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_pipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def _pipeline_strategy(**init_params: Any) -> PipelineStrategy:
    """What Lightning's registry calls for ``Trainer(strategy="pipeline")``: the strategy's module is imported
    then, once every import has finished (registering the class itself, while some module of the package
    that imports Lightning is still being imported, could import that module half-run)."""
    from lightning_pipe.strategy import PipelineStrategy

    return PipelineStrategy(**init_params)


def _fabric_pipeline_strategy(**init_params: Any) -> FabricPipelineStrategy:
    """What Fabric's registry calls for ``Fabric(strategy="pipeline")`` (imported then, as above)."""
    from lightning_pipe.fabric.strategy import FabricPipelineStrategy

    return FabricPipelineStrategy(**init_params)


def _register() -> None:
    """``"pipeline"`` and its variants in the Trainer's and in Fabric's strategy registries."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pipe.config import register_variants

    register_variants(_pipeline_strategy, StrategyRegistry)
    register_variants(_fabric_pipeline_strategy, STRATEGY_REGISTRY)


class _RegisterWithLightning(MetaPathFinder):
    """Registers the strategy once ``import lightning`` has run (every import of a part of Lightning runs
    the package ``lightning`` first, which imports the Trainer and its registry), then leaves
    ``sys.meta_path``: the import finds ``lightning`` as it would without this finder."""

    lightning_pipe_registration = True

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "lightning" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None  # the import system says that there is no Lightning
        loader: Any = spec.loader
        run = loader.exec_module

        def run_then_register(module: ModuleType) -> None:
            run(module)
            del loader.exec_module  # the loader's own method again
            _register()

        loader.exec_module = run_then_register
        return spec


if "lightning" in sys.modules:
    _register()
elif not any(getattr(finder, "lightning_pipe_registration", False) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithLightning())
