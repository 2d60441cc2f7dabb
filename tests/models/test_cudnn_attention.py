"""cuDNN attention's packed layout on CPU: the segment offsets and lengths say what the
reference's document mask says; the per-device call gives the unsharded result on every
mesh the trainer builds (with the XLA attention as the function run per device). The cuDNN
kernel itself is compiled for GPUs in tests/plan/test_plan_memory.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from models.cudnn_attention import segment_layout
from models.llama import causal_document_mask
from tests.support.forced_devices import run_python


def mask_from_layout(offsets, lengths, length):
    """[B, T, S]: what cuDNN's packed layout with its causal mask lets each query see."""
    b, m = lengths.shape
    mask = np.zeros((b, length, length), bool)
    for row in range(b):
        for j in range(m):
            if lengths[row, j] < 0:
                assert offsets[row, j] == -1
                continue
            s = offsets[row, j]
            e = s + lengths[row, j]
            mask[row, s:e, s:e] = np.tril(np.ones((e - s, e - s), bool))
    return mask


def test_layout_is_the_document_mask():
    ids = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3, 3, 4],
                     [5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
                     [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    offsets, lengths = segment_layout(ids, 10)
    assert offsets.shape == (3, 11) and lengths.shape == (3, 10)
    np.testing.assert_array_equal(offsets[0, :5], [0, 3, 5, 9, -1])
    np.testing.assert_array_equal(lengths[0, :5], [3, 2, 4, 1, -1])
    assert (offsets[:, -1] == -1).all()
    np.testing.assert_array_equal(mask_from_layout(np.asarray(offsets), np.asarray(lengths), 10),
                                  np.asarray(causal_document_mask(ids, 3, 10)))


def test_documents_past_the_slots_share_the_last():
    ids = jnp.array([[1, 1, 2, 3, 3, 4, 5, 5]])
    offsets, lengths = segment_layout(ids, 3)
    np.testing.assert_array_equal(offsets, [[0, 2, 3, -1]])
    np.testing.assert_array_equal(lengths, [[2, 1, 5]])
    mask = mask_from_layout(np.asarray(offsets), np.asarray(lengths), 8)
    want = np.asarray(causal_document_mask(ids, 1, 8))
    np.testing.assert_array_equal(mask[:, :3], want[:, :3])  # the first two keep their own
    assert mask[0, 7, 3] and not want[0, 7, 3]  # the last ones see each other


@pytest.mark.slow
def test_per_device_call_matches_unsharded_on_trainer_meshes():
    run_python(["tests/support/per_device_attention_runs.py"], devices=8)
