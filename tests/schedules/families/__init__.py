"""Tests of lightning_pipe.schedules.families."""
