"""``python -m lp_jax.training.prepare_data``: the former path of ``python -m
lp_jax.data.prepare_data``, kept so existing job scripts still run."""
import sys

from lp_jax.data.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
