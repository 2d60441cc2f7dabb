"""``python -m lp_jax.plan``: the trainer's step compiled for a described GPU on any
machine (deviceless), with its memory, GEMMs, kernels, bytes and an estimated step time."""
