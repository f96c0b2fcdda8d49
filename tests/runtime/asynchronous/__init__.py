"""Tests of lightning_pipe.runtime.asynchronous."""
