"""Batched, jitted log-likelihood of continuations: sum_t log p(continuation_t | prefix).

Requests whose model inputs are identical share one row (MMLU's four one-token answers
" A".." D" all read the same prompt), so a row carries up to K target sets. Rows are
sorted by length, batched `batch_size` at a time and right-padded to a power-of-two
bucket (capped at the model's maximum length): the number of compiled shapes stays
logarithmic in the longest prompt. Right padding is harmless for a causal model: padded
positions come after every position that is read.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from lp_jax.errors import UserError
from lp_jax.evaluation.pair_encoding import PairEncoder, ScoringTokenizer, TokenizedRequest

MIN_BUCKET = 16
log = logging.getLogger(__name__)


class UnscorableError(UserError):
    """The model cannot score these requests: token ids it has no embedding row for (a
    tokenizer that is not the model's), or log-likelihoods that are not finite. Scores
    would be NaN and an accuracy computed from them meaningless."""


def bucket_length(length: int, max_length: int) -> int:
    """Smallest power of two >= length (at least MIN_BUCKET), capped at max_length."""
    bucket = max(MIN_BUCKET, 1 << max(0, length - 1).bit_length())
    return min(bucket, max(max_length, length))


def continuation_logprobs(logits_BxLxV, targets_BxKxL, mask_BxKxL):
    """Sum over masked positions of log_softmax(logits)[target]: one sum per (row, k).

    The log-softmax is taken in float32 whatever the logits' dtype (BF16 logits keep
    their values; only the normalization is done more precisely).
    """
    # Casting inside the reduction and after the gather (exact for BF16) keeps XLA from
    # materializing a float32 copy of the B x L x V logits.
    lse_BxL = jax.nn.logsumexp(logits_BxLxV.astype(jnp.float32), axis=-1)
    # Gather the K targets of each position from its own row of logits (indices B x L x K)
    # rather than broadcasting the logits K times.
    picked_BxLxK = jnp.take_along_axis(logits_BxLxV, jnp.swapaxes(targets_BxKxL, 1, 2), axis=-1)
    logp_BxKxL = jnp.swapaxes(picked_BxLxK, 1, 2).astype(jnp.float32) - lse_BxL[:, None, :]
    return jnp.sum(jnp.where(mask_BxKxL, logp_BxKxL, 0.0), axis=-1)


def make_scoring_step(logits_fn: Callable[[Any], Any] | nnx.Module):
    """A jitted (tokens_BxL, targets_BxKxL, mask_BxKxL) -> sums_BxK.

    An NNX model is split so that its parameters are arguments of the compiled step,
    not constants folded into it.
    """
    if isinstance(logits_fn, nnx.Module):
        graphdef, state = nnx.split(logits_fn)

        @jax.jit
        def model_step(state, tokens_BxL, targets_BxKxL, mask_BxKxL):
            model = nnx.merge(graphdef, state)
            return continuation_logprobs(_logits(model(tokens_BxL)), targets_BxKxL, mask_BxKxL)

        return lambda *batch: model_step(state, *batch)

    @jax.jit
    def fn_step(tokens_BxL, targets_BxKxL, mask_BxKxL):
        return continuation_logprobs(_logits(logits_fn(tokens_BxL)), targets_BxKxL, mask_BxKxL)

    return fn_step


def _logits(out):
    """A model's logits: its output, or the first of (logits, extras) (models.moe)."""
    return out[0] if isinstance(out, tuple) else out


def _group_rows(requests: Sequence[TokenizedRequest]) -> list[tuple[tuple[int, ...], list[int]]]:
    """(input_ids, indices of the requests reading it), longest inputs first."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, request in enumerate(requests):
        rows.setdefault(request.input_ids, []).append(i)
    return sorted(rows.items(), key=lambda item: -len(item[0]))


class LoglikelihoodScorer:
    """Scores (context, continuation) pairs with a model and a tokenizer.

    logits_fn: `tokens_BxL (int32) -> logits_BxLxV`, a function or an NNX model.
    max_length: the model's context length; longer pairs lose context from the left.
    vocab_size: ids the model embeds (default: `logits_fn.config.vocab_size` where there
    is one); a request with an id outside it is an UnscorableError.
    """

    def __init__(self, logits_fn, tokenizer: ScoringTokenizer, *, max_length: int,
                 batch_size: int = 16, progress: bool = True, vocab_size: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if vocab_size is None:
            vocab_size = getattr(getattr(logits_fn, "config", None), "vocab_size", None)
        self.vocab_size = vocab_size
        self.encoder = PairEncoder(tokenizer, max_length)
        self.max_length = max_length
        self.batch_size = batch_size
        self.progress = progress
        self._step = make_scoring_step(logits_fn)

    def tokenize(self, pairs: Sequence[tuple[str, str]]) -> list[TokenizedRequest]:
        before = self.encoder.truncated_continuations
        requests = [self.encoder(context, continuation) for context, continuation in pairs]
        cut = self.encoder.truncated_continuations - before
        if cut:
            log.warning(f"{cut} continuation(s) longer than the model's {self.max_length} "
                        "tokens were scored on their last tokens only")
        return requests

    def score(self, pairs: Sequence[tuple[str, str]], desc: str = "scoring") -> list[float]:
        """Log-likelihood sum of each continuation given its context, in input order."""
        return self.score_tokenized(self.tokenize(pairs), desc)

    def score_tokenized(self, requests: Sequence[TokenizedRequest],
                        desc: str = "scoring") -> list[float]:
        if not requests:
            return []
        if self.vocab_size is not None:
            _check_ids(requests, self.vocab_size)
        rows = _group_rows(requests)
        group_width = max(len(indices) for _, indices in rows)
        # One row count for the whole call keeps shapes few; a tiny call is not padded
        # up to a large batch.
        rows_per_batch = min(self.batch_size, 1 << (len(rows) - 1).bit_length())
        results = np.zeros(len(requests), dtype=np.float64)
        batches = range(0, len(rows), rows_per_batch)
        for start in tqdm(batches, desc=desc, disable=not self.progress, unit="batch",
                          dynamic_ncols=True):
            batch = rows[start:start + rows_per_batch]
            length = bucket_length(max(len(ids) for ids, _ in batch), self.max_length)
            tokens = np.zeros((rows_per_batch, length), dtype=np.int32)
            targets = np.zeros((rows_per_batch, group_width, length), dtype=np.int32)
            mask = np.zeros((rows_per_batch, group_width, length), dtype=bool)
            for b, (input_ids, indices) in enumerate(batch):
                n = len(input_ids)
                tokens[b, :n] = input_ids
                for k, i in enumerate(indices):
                    cont = requests[i].continuation_ids
                    # Position p predicts token p + 1: the continuation's tokens are the
                    # targets of the input's last len(cont) positions.
                    targets[b, k, n - len(cont):n] = cont
                    mask[b, k, n - len(cont):n] = True
            sums = np.asarray(jax.device_get(self._step(tokens, targets, mask)))
            for b, (_, indices) in enumerate(batch):
                for k, i in enumerate(indices):
                    results[i] = float(sums[b, k])
        broken = int(np.sum(~np.isfinite(results)))
        if broken:
            raise UnscorableError(f"{broken} of {len(results)} log-likelihoods are not finite "
                                  "(NaN or inf): the model's weights or logits are broken")
        return results.tolist()


def _check_ids(requests: Sequence[TokenizedRequest], vocab_size: int) -> None:
    top = max(max(r.input_ids + r.continuation_ids) for r in requests)
    if top >= vocab_size:
        raise UnscorableError(f"the tokenizer gives token id {top}, outside the model's "
                              f"vocabulary of {vocab_size} ids: it is not this model's tokenizer")
