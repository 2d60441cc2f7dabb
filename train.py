#!/usr/bin/env python
"""Pretrain a Llama in BF16, FP8-CS, MXFP8 or NVFP4.

    python train.py --config configs/tiny.yaml [dotted.key=value ...]

Re-running the same command resumes from the latest checkpoint; docs/training.md lists
every config key. The same run from Python: lp_jax.training.api.
"""
import sys

from lp_jax.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
