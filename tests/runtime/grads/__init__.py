"""Tests of lightning_pipe.runtime.grads."""
