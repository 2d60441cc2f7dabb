"""bench/grad_fidelity.py's arithmetic: cosine and scale slope over the layer weights."""
import numpy as np
import pytest

from bench.grad_fidelity import compare, text_batch


def _tree(scale, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(1).normal(size=(64, 32))
    w = scale * base + noise * rng.normal(size=base.shape)
    # Only 2-D leaves under "layers" count: the norm scale and the embedding do not.
    return {"layers": {"q_proj": {"kernel": w}, "norm": {"scale": rng.normal(size=(32,))}},
            "embed": rng.normal(size=(8, 4))}


def test_identical_gradients_have_cosine_and_slope_one():
    cos, slope = compare(_tree(1.0), _tree(1.0))
    assert cos.shape == (1,) and cos[0] == pytest.approx(1.0) and slope[0] == pytest.approx(1.0)


def test_a_scale_bias_shows_in_the_slope_not_the_cosine():
    cos, slope = compare(_tree(1.0), _tree(0.5))
    assert cos[0] == pytest.approx(1.0) and slope[0] == pytest.approx(0.5)
    cos, slope = compare(_tree(1.0), _tree(1.0, noise=1.0, seed=3))
    assert 0.5 < cos[0] < 0.9 and abs(slope[0] - 1.0) < 0.1  # unbiased noise: slope stays ~1


def test_text_batch_shifts_targets_and_refuses_short_text():
    class Bytes:
        def encode(self, text):
            return list(text.encode())
    batch = text_batch(Bytes(), "abcdefghij" * 10, rows=2, seq_len=8)
    assert batch["tokens"].shape == (2, 8)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
    with pytest.raises(SystemExit, match="tokens"):
        text_batch(Bytes(), "short", rows=2, seq_len=8)
