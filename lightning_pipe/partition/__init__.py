"""Partitioning: balance solvers over cost lists and splitting a Sequential into stages."""

from lightning_pipe.partition.balance import balance_by_cost, balance_uniform, check_balance, stage_bounds
from lightning_pipe.partition.split import (
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
