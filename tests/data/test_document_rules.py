"""Megatron's packing switches and mock data: the examples carry exactly what Megatron's
GPTDataset builds (a NumPy transcription of its _get_ltor_masks_and_position_ids, for every
setting of the three switches), the mock rows are Megatron's MockGPTLowLevelDataset
documents laid out as GPTDataset lays them out, and that stream can be learned."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.data import pipeline as data
from lp_jax.data.pipeline import DocumentRules
from lp_jax.data.tokenizers import ByteTokenizer
from lp_jax.errors import UserError
from lp_jax.training.state import place_batch
from lp_jax.training.step import train_step
from lp_jax.training.validate import resolve
from models.llama import causal_document_mask
from tests.support.toy_models import LM_VOCAB, setup

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id
EOD = 99
# Two documents as lp_jax's text packs them, [BOS] ... [EOS] (EOS is Megatron's EOD there),
# and a row of the mock stream, whose documents end with EOD and have no BOS.
TEXT_ROW = np.array([BOS, 10, 11, 12, EOS, BOS, 20, 21, 22])
EOD_ROW = np.array([7, 8, EOD, 1, 2, 3, EOD, 1, 2])
ALL_RULES = [DocumentRules(*switches) for switches in itertools.product((True, False), repeat=3)]


def megatron_masks(tokens, eod, rules):
    """Megatron's masks and positions for one row's input tokens, in NumPy: (may-attend
    [T, S] bool, loss mask, position ids). An EOD closes a document: later tokens neither
    see it nor anything before it (reset_attention_mask), their positions count from the
    token after it (reset_position_ids), and the target predicted from it is not scored
    (eod_mask_loss)."""
    n = len(tokens)
    attend = np.tril(np.ones((n, n), bool))
    loss = np.ones(n, bool)
    positions = np.arange(n)
    if rules.eod_mask_loss:
        loss[tokens == eod] = False
    previous = 0
    for i in np.flatnonzero(tokens == eod):
        if rules.reset_attention_mask:
            attend[i + 1:, :i + 1] = False
        if rules.reset_position_ids:
            positions[i + 1:] -= i + 1 - previous
            previous = i + 1
    return attend, loss, positions


@pytest.mark.parametrize("rules", ALL_RULES, ids=lambda r: "".join("TF"[not s] for s in (
    r.reset_attention_mask, r.reset_position_ids, r.eod_mask_loss)))
def test_examples_are_megatrons_for_every_switch(rules):
    for example, eod in ((data.pack_sequence(TEXT_ROW, BOS, rules), EOS),
                         (data.pack_eod_sequence(EOD_ROW, EOD, rules), EOD)):
        attend, loss, positions = megatron_masks(example["tokens"], eod, rules)
        np.testing.assert_array_equal(example["loss_mask"], loss)
        np.testing.assert_array_equal(example["positions"], positions)
        # No segment_ids: the model attends causally over the whole row.
        assert ("segment_ids" in example) == rules.reset_attention_mask
        segments = example.get("segment_ids")
        mask = causal_document_mask(None if segments is None else jnp.asarray(segments)[None], 1, 8)
        np.testing.assert_array_equal(np.asarray(mask[0]), attend)


def test_default_and_bridge_rules_by_hand():
    per_document = data.pack_sequence(TEXT_ROW, BOS)  # the defaults, the tiny configs'
    np.testing.assert_array_equal(per_document["segment_ids"], [2, 2, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(per_document["positions"], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(per_document["loss_mask"], [1, 1, 1, 1, 0, 1, 1, 1])
    bridge = data.pack_sequence(TEXT_ROW, BOS, DocumentRules(False, False, False))
    assert sorted(bridge) == ["loss_mask", "positions", "targets", "tokens"]
    np.testing.assert_array_equal(bridge["positions"], np.arange(8))
    assert bridge["loss_mask"].all()


def test_the_switches_are_validated(tmp_path):
    def plan(*overrides):
        return resolve(load_config(None, [f"run_dir={tmp_path}", "data.source=mock", *overrides]))

    c = plan("data.reset_attention_mask=false", "data.reset_position_ids=false",
             "data.eod_mask_loss=false").config.data
    assert (c.reset_attention_mask, c.reset_position_ids, c.eod_mask_loss) == (False, False, False)
    # Per-document attention with positions running on: accepted.
    assert plan("data.reset_position_ids=false").config.data.reset_attention_mask
    with pytest.raises(UserError) as info:
        plan("data.reset_attention_mask=false")  # positions would restart, attention not
    assert str(info.value).startswith("data.reset_position_ids=True is invalid: positions restart")
    with pytest.raises(UserError, match="'data.eod_mask_loss' must be true or false, got 'sometimes'"):
        load_config(None, ["data.eod_mask_loss=sometimes"])


def megatron_mock_rows(seq_len, seed, vocab_size, count):
    """The first ``count`` rows of Megatron's mock training data, built as Megatron builds
    them, document by document."""
    lengths = np.random.default_rng(0).integers(1, 4096, size=100_000, dtype=np.int32)
    documents = np.arange(0, 99_900, dtype=np.int32)  # Bridge's split 9999,8,2
    random = np.random.RandomState(seed)
    random.shuffle(documents)
    starts = np.concatenate([[0], np.cumsum(lengths[documents], dtype=np.int64)])
    samples = np.arange((starts[-1] - 1) // seq_len, dtype=np.uint32)
    random.shuffle(samples)
    rows = []
    for sample in samples[:count]:
        first, last = int(sample) * seq_len, int(sample) * seq_len + seq_len  # last included
        d0, d1 = np.searchsorted(starts, [first, last], side="right") - 1
        text = np.concatenate([np.append(np.arange(1, lengths[d]), vocab_size - 1)
                               for d in documents[d0:d1 + 1]])
        rows.append(text[first - starts[d0]:last - starts[d0] + 1])
    return rows


def test_mock_rows_are_megatrons():
    source = data.MegatronMockSequences("train", 128_256, seq_len=2048, seed=1234)
    tokens = int(np.random.default_rng(0).integers(1, 4096, 100_000, dtype=np.int32)[:99_900].sum())
    assert len(source) == (tokens - 1) // 2048 and tokens > 200e6  # sequences of one epoch
    for index, want in enumerate(megatron_mock_rows(2048, 1234, 128_256, 4)):
        example = source[index]
        np.testing.assert_array_equal(example["tokens"], want[:-1])
        np.testing.assert_array_equal(example["targets"], want[1:])
        np.testing.assert_array_equal(example["loss_mask"], want[:-1] != 128_255)
    row = source[0]["tokens"]
    after_eod = row[1:][row[:-1] == 128_255]
    assert len(after_eod) and (after_eod == 1).all()  # each document counts up from 1
    # The validation split is Megatron's too: its own 80 documents, the same seed.
    val = data.MegatronMockSequences("validation", 128_256, seq_len=2048, seed=1234)
    assert 0 < len(val) < 200 and not np.array_equal(val[0]["tokens"], row)


def test_mock_counts_wrap_in_a_small_vocabulary():
    source = data.MegatronMockSequences("train", 384, seq_len=4096, seed=0)
    tokens = np.concatenate([source[i]["tokens"] for i in range(3)])
    assert tokens.min() >= 1 and tokens.max() == 383  # EOD is the last id
    counts = tokens[tokens != 383]
    assert counts.max() == 382 and (np.diff(counts) == 1).mean() > 0.9  # 1, 2, ..., 382, 1, ...
    with pytest.raises(UserError, match="data.seq_len=999999 is longer than the"):
        data.MegatronMockSequences("validation", 384, seq_len=999_999, seed=0)


def test_the_mock_sources_are_selected_by_name(tmp_path):
    config = load_config(None, ["data.source=mock", "data.seq_len=64"])
    splits = data.open_splits(config.data, None, LM_VOCAB, seed=3)
    assert isinstance(splits.train, data.MegatronMockSequences) and splits.val.split == "validation"
    uniform = load_config(None, ["data.source=mock_uniform", "data.seq_len=64"])
    assert isinstance(data.open_splits(uniform.data, None, LM_VOCAB, seed=3).train, data.MockSequences)


def _losses(source, steps):
    graphdef, spec, state = setup()
    stream = data.train_iterator(source, 0, 8, read_threads=0)
    losses = []
    for _ in range(steps):
        state, m = train_step(graphdef, spec, state, place_batch(next(stream), 1, spec.mesh))
        losses.append(float(m["loss"]))
    return losses


@pytest.mark.slow
def test_megatron_mock_is_learnable_where_uniform_tokens_are_not():
    # The toy LM reads one token (and its position): enough to learn "the next id is one more".
    # 64 tokens a row (the toy takes any length): 3.2M rows for Megatron's shuffle, not 25M.
    megatron = _losses(data.MegatronMockSequences("train", LM_VOCAB, 64, seed=0), 20)
    uniform = _losses(data.MockSequences(LM_VOCAB, 64, seed=0), 20)
    assert np.mean(megatron[-3:]) < 0.5 * megatron[0]
    assert np.mean(uniform[-3:]) > np.log(LM_VOCAB) - 0.3
