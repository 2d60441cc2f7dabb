"""Megatron's packing switches: the examples carry exactly what Megatron's GPTDataset
builds (a NumPy transcription of its _get_ltor_masks_and_position_ids, for every setting of
the three switches)."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from lp_jax.config.yaml_io import load_config
from lp_jax.data import pipeline as data
from lp_jax.data.pipeline import DocumentRules
from lp_jax.data.tokenizers import ByteTokenizer
from lp_jax.errors import UserError
from lp_jax.training.validate import resolve
from models.llama import causal_document_mask

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
