"""Downstream evaluation: `python eval.py --checkpoint RUN_DIR | --hf HF_DIR --tasks ...`.

See lp_jax/evaluation/cli.py for the options and docs/evaluation.md for the method.
"""

import sys

from lp_jax.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
