"""The training loop behind train.py: the jitted step, its state and optimizer, metrics,
the command line (``cli``) and the Megatron Bridge-shaped Python API (``api``)."""
