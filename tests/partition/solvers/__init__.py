"""Tests of lightning_pipe.partition.solvers."""
