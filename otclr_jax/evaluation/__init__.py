"""Evaluation of frozen encoders: one module per evaluator.

`features` (extraction and cache), `probe` (linear probe), `knn`, `clusters`
(cluster metrics, the head that makes z), `view_quality` (both view
generators embedded by one network). `otclr_jax.evaluate` runs them on a
checkpoint; none of them imports training or figures.
"""
