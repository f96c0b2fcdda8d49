"""lightning-pipe: pipeline model parallelism for PyTorch Lightning.

``import lightning_pipe`` registers ``Trainer(strategy="pipeline")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.partition.materialize import init_like_pipeline
from lightning_pipe.runtime.loss_weights import token_count
from lightning_pipe.strategy import PipelineStrategy

PipelineStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = ["PipelineStrategy", "__version__", "init_like_pipeline", "token_count"]
