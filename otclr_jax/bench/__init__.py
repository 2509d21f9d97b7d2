"""Benchmarks of the view generator, the training step and the encoder."""
