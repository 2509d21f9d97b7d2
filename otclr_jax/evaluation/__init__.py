"""Evaluation of frozen encoders; imports neither training nor figures."""
