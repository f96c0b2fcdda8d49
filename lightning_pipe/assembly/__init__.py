"""From a module and the run's arguments to this rank's pipeline, without the Trainer: the split into
stages, the options resolved once, the layout's refusals, and :func:`build_pipeline` for a plain
PyTorch loop (the Trainer's setup uses the same steps)."""
