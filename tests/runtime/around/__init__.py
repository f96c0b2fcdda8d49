"""Tests of lightning_pipe.runtime.around."""
