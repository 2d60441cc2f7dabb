"""lp_jax.study.stats: Student-t quantiles, paired gaps, intervals and verdicts, by hand."""
import math

import pytest

from lp_jax.study import stats

# Two-sided 95% critical values of Student's t (any statistics table).
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 5: 2.5706, 10: 2.2281, 30: 2.0423, 120: 1.9799}


@pytest.mark.parametrize("df,expected", sorted(T975.items()))
def test_t_quantile_matches_published_tables(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_t_cdf_symmetry_and_known_values():
    assert stats.t_cdf(0.0, 4) == pytest.approx(0.5)
    assert stats.t_cdf(-2.0, 7) == pytest.approx(1 - stats.t_cdf(2.0, 7))
    # df = 1 is the Cauchy distribution: P(T <= 1) = 3/4
    assert stats.t_cdf(1.0, 1) == pytest.approx(0.75)


def test_paired_gaps_only_on_common_finite_seeds():
    ref = {0: 2.0, 1: 2.0, 2: 2.0, 3: None}
    other = {0: 2.2, 1: 1.9, 3: 2.0, 4: 2.0, 2: math.nan}
    assert stats.paired_gaps(ref, other) == pytest.approx({0: 0.1, 1: -0.05})


def test_mean_ci_by_hand():
    # values 1, 2, 3: mean 2, sd 1, stderr 1/sqrt(3), half width t(0.975, 2) / sqrt(3)
    out = stats.mean_ci([0.01, 0.02, 0.03])
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert out["n"] == 3 and out["mean"] == pytest.approx(0.02)
    assert out["sd"] == pytest.approx(0.01)
    assert out["ci"] == pytest.approx([0.02 - half, 0.02 + half], abs=1e-7)


def test_one_seed_has_no_interval_and_says_so():
    out = stats.mean_ci([0.012])
    assert out["ci"] is None and out["mean"] == pytest.approx(0.012)
    assert "one seed only" in stats.verdict(out)
    assert "undecided" in stats.target_verdict(out, 0.01)
    assert stats.verdict(stats.mean_ci([])) == "no paired seeds: nothing to compare"


def test_planted_gaps_get_the_right_verdicts():
    worse = stats.mean_ci([0.048, 0.052, 0.05, 0.049, 0.051, 0.05])  # 5% worse, little noise
    assert stats.verdict(worse).startswith("worse than BF16 by 5.00%")
    assert stats.target_verdict(worse, 0.03).startswith("missed")
    same = stats.mean_ci([0.01, -0.012, 0.004, -0.003, 0.008, -0.007])
    assert stats.verdict(same).startswith("no difference from BF16 detected")
    assert stats.target_verdict(same, 0.03).startswith("met")
    assert stats.target_verdict(same, 0.005).startswith("not shown")
    better = stats.mean_ci([-0.02, -0.021, -0.019])
    assert stats.verdict(better).startswith("better than BF16 by 2.00%")
