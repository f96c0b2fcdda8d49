"""Block containers: a stage's blocks run inside the model's own loop, and what may not cross between stages."""
