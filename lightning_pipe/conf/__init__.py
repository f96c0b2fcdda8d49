"""Hydra's configuration of the ``lightning-pipe`` command (recipes, strategies, trainers), shipped in the package."""
