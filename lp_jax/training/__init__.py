"""Training: configs, data, optimizer, checkpoints, metrics and the loop behind train.py.

Submodules import JAX lazily where they can, so that a bad config is reported before
anything heavy is loaded. The Python API (Megatron Bridge's shape) lives in
``lp_jax.training.api``.
"""
