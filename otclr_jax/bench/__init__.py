"""Benchmarks of the view generator, the training step and the encoder.

One module per subcommand of `python -m otclr_jax.bench` (`__main__`):
`ot_views` (ot), `train_step` (train), `resnet` (resnet); `common` holds the
timing and FLOP counting they share.
"""
