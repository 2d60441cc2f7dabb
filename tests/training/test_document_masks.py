"""The packing switches through the model, both attention paths and the validation loss,
on a two-document row of a one-layer Llama in float32: the per-document loss is that of
each document run alone, the plain causal loss that of the whole row as one sequence, each
summed by hand in NumPy; the two differ. On CPU the cuDNN path runs up to the kernel call,
whose stand-in applies the mask the call asks for."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lp_jax.data import pipeline as data
from lp_jax.data.pipeline import DocumentRules
from lp_jax.data.tokenizers import ByteTokenizer
from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import state_shardings
from lp_jax.training import state as state_lib
from lp_jax.training.optimizer import make_optimizer
from lp_jax.training.state import place_batch
from lp_jax.training.step import StepSpec, eval_step
from models import llama
from models.layers import attention_core
from tests.support.toy_models import opt_spec

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id
ROW = np.array([BOS, 10, 11, 12, EOS, BOS, 20, 21, 22])  # [BOS] doc [EOS] [BOS] doc ...
PER_DOCUMENT, BRIDGE = DocumentRules(), DocumentRules(False, False, False)


def config(attention_impl):
    return llama.preset("tiny", num_layers=1, dtype=jnp.float32, attention_impl=attention_impl)


@functools.cache
def setup(attention_impl):
    """(graphdef, spec, state) of a one-layer tiny Llama on a one-device mesh (the same
    weights for both attention paths)."""
    mesh = make_mesh(1, 1)
    spec = StepSpec(opt_spec(), 1, mesh)
    tx = make_optimizer(spec.optimizer)
    build = lambda: llama.Llama(config(attention_impl), rngs=nnx.Rngs(0))  # noqa: E731
    graphdef, params, rest = state_lib.split_model(nnx.eval_shape(build))
    target = state_lib.abstract_state((graphdef, params, rest), tx, 0)
    return graphdef, spec, state_lib.init_state(build, tx, 0, state_shardings(target, mesh))


def validation_loss(attention_impl, row, rules):
    """(summed NLL, token count) of ``row`` packed under ``rules``, by the eval step."""
    graphdef, spec, state = setup(attention_impl)
    example = data.pack_sequence(row, BOS, rules)
    batch = {k: v[None] for k, v in example.items()}
    nll, count = eval_step(graphdef, spec, state, place_batch(batch, 1, spec.mesh))
    return float(nll), float(count)


@functools.cache
def plain_forward():
    graphdef, _, state = setup("xla")
    forward = jax.jit(lambda params, rest, tokens: nnx.merge(graphdef, params, rest)(tokens))
    return functools.partial(forward, state["params"], state["rest"])


def logits_alone(tokens):
    """The model's logits for ``tokens`` as a row of its own: positions from 0, causal
    (so the padding to 8 tokens, after them, changes nothing: one compile for all)."""
    padded = np.pad(tokens, (0, 8 - len(tokens)), constant_values=BOS)
    return np.asarray(plain_forward()(jnp.asarray(padded)[None])[0, :len(tokens)], np.float64)


def summed_nll(logits, targets, mask):
    """(sum of -log softmax(logits)[target] over the unmasked targets, their count)."""
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    picked = logits[np.arange(len(targets)), targets]
    return float(((log_z - picked) * mask).sum()), float(mask.sum())


@pytest.mark.slow
def test_per_document_and_plain_causal_losses_by_hand():
    targets = ROW[1:]
    # Per document: each document alone, from position 0; the target that opens the
    # second document (its BOS, predicted from the first's EOS) is not scored.
    alone = np.concatenate([logits_alone(ROW[:5]), logits_alone(ROW[5:8])])
    want_doc = summed_nll(alone, targets, np.arange(8) != 4)
    # Plain causal: the whole row as one sequence, positions 0..7, every target scored.
    want_causal = summed_nll(logits_alone(ROW[:8]), targets, np.ones(8))
    got_doc = validation_loss("xla", ROW, PER_DOCUMENT)
    got_causal = validation_loss("xla", ROW, BRIDGE)
    assert got_doc[1] == 7 and got_causal[1] == 8
    np.testing.assert_allclose(got_doc, want_doc, rtol=2e-6)
    np.testing.assert_allclose(got_causal, want_causal, rtol=2e-6)
    # Over the targets both score, the second document's differ: it saw the first.
    mask = np.arange(8) != 4
    assert abs(summed_nll(logits_alone(ROW[:8]), targets, mask)[0] - want_doc[0]) > 1e-3
    assert not np.allclose(alone[5:], logits_alone(ROW[:8])[5:], atol=1e-3)


def fake_cudnn_kernel(calls):
    """Stands in for JAX's cuDNN attention: records the mask type and applies that mask
    (causal, or causal within each segment of the packed layout) with the XLA attention."""
    def kernel(q, k, v, *, scale, mask_type, qkv_layout, q_seqlen=None, kv_seqlen=None,
               q_offsets=None, kv_offsets=None):
        assert qkv_layout == "BTNH" and scale == pytest.approx(q.shape[-1] ** -0.5)
        calls.append(mask_type.name)
        b, t = q.shape[:2]
        segments = None
        if q_offsets is not None:
            at = jnp.arange(t)[None, :, None]
            starts, lengths = q_offsets[:, None, :-1], q_seqlen[:, None, :]
            inside = (lengths > 0) & (at >= starts) & (at < starts + lengths)
            segments = jnp.argmax(inside, axis=-1) + 1
        return attention_core(q, k, v, llama.causal_document_mask(segments, b, t))
    return kernel


@pytest.mark.parametrize("rules, mask_type", [(PER_DOCUMENT, "PADDING_CAUSAL"), (BRIDGE, "CAUSAL")])
def test_cudnn_path_gets_the_mask_the_switch_asks_for(rules, mask_type, monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo

    calls = []
    monkeypatch.setattr(fused_attention_stablehlo, "dot_product_attention", fake_cudnn_kernel(calls))
    jax.clear_caches()  # the stand-in is called while the step is traced: trace it again
    got = validation_loss("cudnn", ROW, rules)
    assert set(calls) == {mask_type}
    np.testing.assert_allclose(got, validation_loss("xla", ROW, rules), rtol=2e-6)
