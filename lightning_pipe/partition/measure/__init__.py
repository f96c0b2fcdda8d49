"""Measuring on the device: layer costs profiled, and every rank's speed and free memory gathered."""
