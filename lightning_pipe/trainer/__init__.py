"""Everything that knows the Trainer: processes and launching, signals and failures, precision,
the steps and their results, the setup checks, assembling the pipeline in setup, and the
checkpoint hooks. The core below (``schedules``, ``partition``, ``runtime``, ``checkpoint``,
``weights``, ``plan``) imports no Lightning."""
