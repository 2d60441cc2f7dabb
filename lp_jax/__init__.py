"""lp_jax: low-precision (BF16, FP8-CS, MXFP8, NVFP4) training for Flax NNX models."""
