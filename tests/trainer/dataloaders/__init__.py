"""Tests of lightning_pipe.trainer.dataloaders."""
