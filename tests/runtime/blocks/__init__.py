"""Tests of lightning_pipe.runtime.blocks."""
