"""`python -m lp_jax.study`: see ``lp_jax.study.cli``."""
import sys

from lp_jax.study.cli import main

if __name__ == "__main__":
    sys.exit(main())
