"""Evaluation of frozen encoders; evaluators yield (key path, value) pairs.

None of these modules imports training or figures.
"""
