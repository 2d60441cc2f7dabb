"""``python -m lp_jax.training.prepare_data``: the same command as ``python -m
lp_jax.data.prepare_data``, for job scripts that call it by this name."""
import sys

from lp_jax.data.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
