"""Partitioning: the model split into stages. ``solvers/``: pure balance solvers over cost lists; ``stages/``:
building the stage modules; ``measure/``: measuring layer costs and ranks on the device."""

from lightning_pipe.partition.solvers.balance import balance_by_cost, balance_uniform, check_balance, stage_bounds
from lightning_pipe.partition.stages.split import (
    BALANCE_MODES,
    check_stage_parameters,
    find_sequential,
    foreign_parameters,
    layer_owners,
    parameter_costs,
    place,
    release_elsewhere,
    release_foreign_parameters,
    release_parameters,
    resolve_balance,
    stage_layers,
    tied_parameters,
)

__all__ = [
    "BALANCE_MODES",
    "balance_by_cost",
    "balance_uniform",
    "check_balance",
    "check_stage_parameters",
    "find_sequential",
    "foreign_parameters",
    "layer_owners",
    "parameter_costs",
    "place",
    "release_elsewhere",
    "release_foreign_parameters",
    "release_parameters",
    "resolve_balance",
    "stage_bounds",
    "stage_layers",
    "tied_parameters",
]
