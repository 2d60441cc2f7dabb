"""The log-likelihood scorer on toy models whose log-likelihoods are known."""

import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.evaluation.metrics import doc_metrics
from lp_jax.evaluation.pair_encoding import PairEncoder
from lp_jax.evaluation.scorer import LoglikelihoodScorer, bucket_length
from tests.support.eval_toys import (
    VOCAB,
    BigramModel,
    ByteTokenizer,
    WordTokenizer,
    bigram_logits,
    reference_loglikelihood,
)

MEMORY_EMB = np.random.default_rng(1).normal(size=(VOCAB, 8)).astype(np.float32)
MEMORY_OUT = np.random.default_rng(2).normal(size=(8, VOCAB)).astype(np.float32)


def memory_logits(tokens_BxL):
    """Causal, with long memory: position t sees the running mean of tokens 0..t."""
    x = jnp.asarray(MEMORY_EMB)[tokens_BxL]
    mean = jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]
    return mean @ jnp.asarray(MEMORY_OUT)


PAIRS = [("Question: what is two plus two?\nAnswer:", " four"),
         ("Question: what is two plus two?\nAnswer:", " five, or so"),
         ("Roof shingle removal: A man is sitting on a roof. He", " is ripping level tiles off."),
         ("short ", "context"),  # trailing space moves to the continuation
         ("x", " y"),
         ("Answer:", " A"), ("Answer:", " B"), ("Answer:", " C")]  # shared input rows


def test_encode_pair_follows_the_harness():
    tok = WordTokenizer()
    enc = PairEncoder(tok, max_length=100)
    ctx, cont = enc.encode_pair("Answer: ", "A")  # the space goes with "A"
    assert cont == tok.encode(" A") and ctx == tok.encode("Answer:")
    bytes_enc = PairEncoder(ByteTokenizer(), max_length=8)
    request = bytes_enc("abcdefghij", "XYZ")
    full = [256] + list(b"abcdefghijXYZ")
    assert request.input_ids == tuple(full[-9:-1])  # context cut from the left
    assert request.continuation_ids == tuple(b"XYZ")
    # Longer than the model (the harness asserts): scored on its last max_length tokens.
    request = bytes_enc("a", "123456789")
    assert request.continuation_ids == tuple(b"23456789") and request.input_ids == tuple(b"12345678")
    assert bytes_enc.truncated_continuations == 1


def test_scores_equal_the_known_loglikelihoods():
    scorer = LoglikelihoodScorer(bigram_logits, ByteTokenizer(), max_length=64,
                                 batch_size=4, progress=False)
    got = scorer.score(PAIRS)
    want = [reference_loglikelihood(c, k) for c, k in PAIRS]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # A long context is cut from the left to max_length, as the harness does.
    long_pair = ("word " * 40, "end")
    short = LoglikelihoodScorer(bigram_logits, ByteTokenizer(), max_length=16, progress=False)
    np.testing.assert_allclose(short.score([long_pair]),
                               [reference_loglikelihood(*long_pair, max_length=16)], rtol=1e-5)


@pytest.mark.parametrize("batch_size", [2, 3, 16])
def test_batching_and_padding_do_not_change_loglikelihoods(batch_size):
    one_at_a_time = LoglikelihoodScorer(memory_logits, ByteTokenizer(), max_length=48,
                                        batch_size=1, progress=False)
    singles = [one_at_a_time.score([pair])[0] for pair in PAIRS + [("word " * 20, "end")]]
    batched = LoglikelihoodScorer(memory_logits, ByteTokenizer(), max_length=48,
                                  batch_size=batch_size, progress=False)
    np.testing.assert_allclose(batched.score(PAIRS + [("word " * 20, "end")]), singles,
                               rtol=1e-5, atol=1e-5)


def test_nnx_model_is_scored_with_its_parameters_as_arguments():
    scorer = LoglikelihoodScorer(BigramModel(), ByteTokenizer(), max_length=64,
                                 batch_size=4, progress=False)
    want = [reference_loglikelihood(c, k) for c, k in PAIRS]
    # BF16 logits: each token's log-probability is off by at most a few BF16 ulps.
    np.testing.assert_allclose(scorer.score(PAIRS), want, rtol=2e-2, atol=0.1)


def test_acc_and_acc_norm_disagree_on_a_crafted_case():
    """A uniform model gives -len(tokens) * log V: the short choice wins acc, but per
    character the long one is likelier (9 tokens over 8 characters vs 2 over 1)."""
    scorer = LoglikelihoodScorer(lambda t: jnp.zeros(t.shape + (VOCAB,)), ByteTokenizer(),
                                 max_length=32, progress=False)
    choices = ["a", "bbbbbbbb"]
    lls = scorer.score([("Question: which?\nAnswer:", " " + c) for c in choices])
    np.testing.assert_allclose(lls, [-2 * np.log(VOCAB), -9 * np.log(VOCAB)], rtol=1e-6)
    metrics = doc_metrics(lls, gold=1, choice_texts=choices)
    assert metrics["acc"] == 0.0 and metrics["acc_norm"] == 1.0


def test_bucket_lengths_are_powers_of_two_capped_at_max_length():
    assert [bucket_length(n, 4096) for n in (1, 16, 17, 100, 1025)] == [16, 16, 32, 128, 2048]
    assert bucket_length(300, 300) == 300 and bucket_length(200, 300) == 256
