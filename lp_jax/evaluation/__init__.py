"""Downstream evaluation: lm-evaluation-harness-style log-likelihood multiple choice."""
