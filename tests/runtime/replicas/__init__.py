"""Tests of lightning_pipe.runtime.replicas."""
