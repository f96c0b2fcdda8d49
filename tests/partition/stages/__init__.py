"""Tests of lightning_pipe.partition.stages."""
