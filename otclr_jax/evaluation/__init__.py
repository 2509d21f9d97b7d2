"""Evaluation of frozen encoders: one module per job.

`evaluate` restores a checkpoint and runs the evaluators the config names;
each evaluator module (`probe`, `knn`, `clusters`, `view_quality`) has an
`evaluate(ctx)` that yields (key path, value) pairs. `features` extracts and
caches encoder features, `metrics` holds the cluster and view metrics and
`monitor` the kNN monitor that training runs. None of them imports training
or figures.
"""
