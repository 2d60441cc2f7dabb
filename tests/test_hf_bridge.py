"""A training run to a Hugging Face folder: `python -m models.hf export RUN_DIR`, one-line
errors.

transformers is not installed here: the export is loaded by tests/hf_numpy_llama.py, a NumPy
reading of the folder the way LlamaForCausalLM reads it, which is first checked against the
transformers logits committed in tests/fixtures/hf (scripts/hf_reference.py made them)."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

import lp_jax
from lp_jax.training.checkpoint import Checkpointer, abstract_like
from lp_jax.training.loop import run
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.state import abstract_state, split_model
from lp_jax.training.tokenizers import ByteTokenizer, HFTokenizer
from lp_jax.training.validate import resolve
from models import hf_cli, llama
from models.hf_config import tensor_map
from tests import hf_numpy_llama
from tests.test_hf import TIED, UNTIED
from tests.test_training_loop import tiny

TEXT = "import json\ndef main(argv):\n    return json.dumps(argv)  # Größe, 日本語 🙂\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory, token_cache):
    """A tiny BF16 run of 3 steps (checkpoints 2 and 3) and its export at step 3."""
    root = tmp_path_factory.mktemp("bridge")
    config = tiny(root / "src", token_cache, "steps=3", "checkpoint.every=2", "checkpoint.keep=3")
    run(resolve(config))
    assert hf_cli.main(["export", str(root / "src"), str(root / "hf")]) == 0
    return config, root


def _masters(config, step):
    """(plan, full train state) of a run's checkpoint, restored as a resume does."""
    plan = resolve(config)
    tx = make_optimizer(OptimizerSpec.from_config(config))
    abstract = nnx.eval_shape(lambda: llama.Llama(plan.model_config, rngs=nnx.Rngs(0)))
    target = abstract_state(split_model(abstract), tx, config.seed)
    ckpt = Checkpointer(os.path.join(config.run_dir, "checkpoints"), 5)
    state, _ = ckpt.restore(step, abstract_like(target), None)
    ckpt.close()
    return plan, state


def _flat_params(state):
    return {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(state["params"])}


def _hf_files(folder):
    """HF name -> array for every weight of a folder."""
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize("folder, style", [(UNTIED, "v5"), (TIED, "v4")])
def test_numpy_reader_matches_transformers(folder, style):
    """The stand-in for transformers is checked against transformers itself."""
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    out = hf_numpy_llama.logits(folder, ref["tokens"], style)
    assert np.abs(out - ref["logits"]).max() < 1e-4 < 1.0 < np.abs(ref["logits"]).max()


def test_exported_run_loads_as_llama_for_causal_lm(source):
    config, root = source
    hf_dir = str(root / "hf")
    assert sorted(os.listdir(hf_dir)) == ["config.json", "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]
    exported = json.load(open(os.path.join(hf_dir, "config.json")))
    # Every key transformers wrote for the fixture model is there, with the same type.
    written = json.load(open(os.path.join(UNTIED, "config.json")))
    metadata_only = {"transformers_version", "use_cache", "pretraining_tp", "attention_dropout"}
    for key in set(written) - metadata_only:
        assert key in exported and type(exported[key]) is type(written[key]) or \
            written[key] is None, key
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (256, 257)
    # The tensor names are transformers' own (the fixture's, for 4 layers) with its metadata.
    names = set(_hf_files(hf_dir))
    per_layer = {n.split(".", 3)[3] for n in load_file(os.path.join(UNTIED, "model.safetensors"))
                 if n.startswith("model.layers.0.")}
    assert names == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{n}" for i in range(4) for n in per_layer}
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    # The run's own forward (FP32 compute) on text encoded by the exported tokenizer.json.
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).encode(TEXT).ids
    assert ids == [256] + list(TEXT.encode())  # BOS as in training, then the bytes
    tokens = np.asarray([ids], np.int32)
    plan, state = _masters(config, 3)
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: llama.Llama(
        plan.model_config.replace(dtype=jnp.float32), rngs=nnx.Rngs(0))))[0], state["params"])
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    for style in ("v5", "v4"):  # config.json read as transformers 5.x and 4.x read it
        theirs = hf_numpy_llama.logits(hf_dir, tokens, style)
        assert np.abs(theirs - ours).max() < 1e-4 < 1.0 < np.abs(theirs).max()


def test_a_step_folder_exports_that_step(source, tmp_path):
    _, root = source
    step_dir = root / "src" / "checkpoints" / "2"  # where a user points first
    assert hf_cli.main(["export", str(step_dir), str(tmp_path / "a")]) == 0
    assert hf_cli.main(["export", str(root / "src"), str(tmp_path / "b"), "--step", "2"]) == 0
    a, b, latest = _hf_files(tmp_path / "a"), _hf_files(tmp_path / "b"), _hf_files(root / "hf")
    assert a.keys() == b.keys() == latest.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], latest[k]) for k in a)  # step 2, not the latest


def test_byte_tokenizer_files_encode_as_the_run(source):
    _, root = source
    hf_dir = root / "hf"
    from tokenizers import Tokenizer

    from lp_jax.evaluation.hf_tokenizer import HFTokenizerFile

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    rng = np.random.default_rng(0)
    for text in [TEXT, "", " \t\r\n\x00\x7f", "".join(map(chr, rng.integers(0x20, 0xD7FF, 300)))]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ByteTokenizer().encode(text)
        assert tok.decode(ids) == text
    assert HFTokenizerFile(str(hf_dir)).bos_id == 256  # eval.py --hf puts BOS first, as training did
    as_run = HFTokenizer(hf_dir / "tokenizer.json")  # data.tokenizer=hf:<export>/tokenizer.json
    assert (as_run.vocab_size, as_run.bos_id, as_run.eos_id) == (259, 256, 257)
    config = json.load(open(hf_dir / "tokenizer_config.json"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert [tok.token_to_id(config[k]) for k in ("bos_token", "eos_token", "pad_token")] == [256, 257, 258]


@pytest.mark.slow
def test_nvfp4_run_exports_its_fp32_masters(tmp_path, token_cache):
    config = tiny(tmp_path / "run", token_cache, "steps=2", "precision=nvfp4",
                  "precision.last_bf16_layers=1")
    run(resolve(config))
    plan, state = _masters(config, 2)
    masters = _flat_params(state)
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert hf_cli.main(["export", str(tmp_path / "run"), str(out), "--dtype", dtype]) == 0
        exported = _hf_files(out)
        for name, path, transpose in tensor_map(plan.model_config):
            want = masters[path].T if transpose else masters[path]
            assert exported[name].tobytes() == want.astype(jnp.dtype(dtype)).tobytes(), name
    # Control: NVFP4-quantized weights differ from the masters, so a leak would show above.
    kernel = masters[("layers", 0, "attn", "q_proj", "kernel")]
    fp4 = lp_jax.dequantize(lp_jax.quantize(jnp.asarray(kernel), "nvfp4", axis=0, block_2d=True))
    assert not np.array_equal(np.asarray(fp4), kernel)


def test_bad_inputs_are_one_line_and_exit_2(source, tmp_path, capsys):
    _, root = source
    src = str(root / "src")
    capsys.readouterr()
    # Export: a run folder without checkpoints, a step that does not exist, a preset.
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.yaml").write_text("model: {preset: tiny}\n")
    for args, message in [
        ([str(tmp_path / "empty_run"), str(tmp_path / "o")], "empty_run: no checkpoints"),
        ([src, str(tmp_path / "o"), "--step", "7"], "no checkpoint of step 7; saved steps: 2, 3"),
        ([os.path.join(src, "checkpoints", "2"), str(tmp_path / "o"), "--step", "3"],
         "is the checkpoint of step 2, not step 3"),
        ([src, str(tmp_path / "o"), "--preset", "tiny"], "--preset is for a bare state checkpoint"),
    ]:
        assert hf_cli.main(["export", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "o")
