"""Accuracy and standard errors as lm-evaluation-harness computes them."""

import math

import pytest

from lp_jax.evaluation.metrics import doc_metrics, group_summary, mean_stderr, pooled_stderr, task_summary


def test_acc_acc_norm_acc_bytes():
    # "é" is 1 character but 2 bytes: normalizing by characters or bytes picks differently.
    m = doc_metrics([-1.5, -2.5], gold=1, choice_texts=["é", "ab"])
    assert m == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 0.0}
    # Ties go to the first choice, as np.argmax.
    assert doc_metrics([-1.0, -1.0], gold=1, choice_texts=["a", "b"])["acc"] == 0.0


def test_stderr_is_sample_std_over_sqrt_n():
    # mean 0.75; sample variance (3 * 0.25^2 + 0.75^2) / 3 = 0.25; std 0.5; / sqrt(4)
    assert mean_stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25)
    assert mean_stderr([1.0]) is None
    s = task_summary([{"acc": 1.0, "acc_norm": 0.0, "acc_bytes": 0.0},
                      {"acc": 0.0, "acc_norm": 0.0, "acc_bytes": 1.0}])
    assert s["n"] == 2 and s["acc"] == 0.5 and s["acc_stderr"] == pytest.approx(0.5)
    assert s["acc_norm_stderr"] == 0.0


def test_pooled_stderr_of_a_size_weighted_group():
    # (1 * 0.5^2 * 2 + 2 * 0.2^2 * 3) / (5 - 2) / 5, square-rooted
    assert pooled_stderr([0.5, 0.2], [2, 3]) == pytest.approx(math.sqrt(0.74 / 3 / 5))
    a = {"acc": 0.5, "acc_stderr": 0.5, "acc_norm": 1.0, "acc_norm_stderr": 0.0,
         "acc_bytes": 0.0, "acc_bytes_stderr": 0.0, "n": 2}
    b = {"acc": 1.0, "acc_stderr": 0.2, "acc_norm": 0.0, "acc_norm_stderr": 0.0,
         "acc_bytes": 0.0, "acc_bytes_stderr": 0.0, "n": 3}
    g = group_summary([a, b])
    assert g["n"] == 5 and g["acc"] == pytest.approx(0.8) and g["acc_norm"] == pytest.approx(0.4)
    assert g["acc_stderr"] == pytest.approx(math.sqrt(0.74 / 3 / 5))
