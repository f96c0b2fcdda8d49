"""Activation memory: what a stage keeps, recomputes or offloads to host memory, and the meter that counts it."""
