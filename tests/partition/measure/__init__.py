"""Tests of lightning_pipe.partition.measure."""
