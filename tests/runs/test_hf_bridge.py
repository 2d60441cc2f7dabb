"""A training run to a Hugging Face folder and back: `python -m lp_jax.export RUN_DIR`,
`init.hf` / `init.checkpoint`, one-line errors.

transformers is not installed here: the export is loaded by tests/support/hf_numpy_llama.py, a NumPy
reading of the folder the way LlamaForCausalLM reads it, which is first checked against the
transformers logits committed in tests/fixtures/hf (scripts/hf_reference.py made them)."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

import lp_jax
from lp_jax import export
from lp_jax.data import pipeline as data_lib
from lp_jax.data.tokenizers import ByteTokenizer, HFTokenizer
from lp_jax.errors import UserError
from lp_jax.evaluation import loading
from lp_jax.runs.checkpoint import Checkpointer, abstract_like
from lp_jax.training import cli
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.training.state import abstract_state, split_model
from lp_jax.training.step import token_nll
from lp_jax.training.validate import resolve
from models import llama
from models.hf_config import tensor_map
from tests.models.test_hf import TIED, UNTIED
from tests.support import hf_numpy_llama
from tests.support.eval_toys import write_byte_level_tokenizer
from tests.training.test_training_loop import tiny

TEXT = "import json\ndef main(argv):\n    return json.dumps(argv)  # Größe, 日本語 🙂\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory, token_cache):
    """A tiny BF16 run of 3 steps (checkpoints 2 and 3) and its export at step 3."""
    root = tmp_path_factory.mktemp("bridge")
    config = tiny(root / "src", token_cache, "steps=3", "checkpoint.every=2", "checkpoint.keep=3")
    run(resolve(config))
    assert export.main([str(root / "src"), str(root / "hf")]) == 0
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
    assert sorted(os.listdir(hf_dir)) == ["config.json", "lp_jax_export.json", "model.safetensors",
                                          "tokenizer.json", "tokenizer_config.json"]
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
    assert export.main([str(step_dir), str(tmp_path / "a")]) == 0
    assert export.main([str(root / "src"), str(tmp_path / "b"), "--step", "2"]) == 0
    a, b, latest = _hf_files(tmp_path / "a"), _hf_files(tmp_path / "b"), _hf_files(root / "hf")
    assert a.keys() == b.keys() == latest.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], latest[k]) for k in a)  # step 2, not the latest


def test_byte_tokenizer_files_encode_as_the_run(source):
    _, root = source
    hf_dir = root / "hf"
    from tokenizers import Tokenizer

    from lp_jax.data.tokenizers import HFTokenizerFile

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


def test_eval_reads_the_export_as_it_reads_the_run(source):
    """eval.py --hf on the export scores what eval.py --checkpoint scores on the run."""
    _, root = source
    exported = loading.load_from_hf_dir(str(root / "hf"), dtype=jnp.float32)
    trained = loading.load_from_run_dir(str(root / "src"), dtype=jnp.float32)
    assert exported.max_length == trained.max_length == 256
    assert exported.tokenizer.bos_id == trained.tokenizer.bos_id == 256
    assert exported.tokenizer.encode(TEXT) == trained.tokenizer.encode(TEXT)
    tokens = jnp.asarray([[256] + trained.tokenizer.encode(TEXT)], jnp.int32)
    forward = nnx.jit(lambda m, t: m(t))
    np.testing.assert_array_equal(forward(exported.model, tokens), forward(trained.model, tokens))


def _first_batch_loss(plan, params):
    """The loss of `params` on the run's first batch, with its precision recipe."""
    cfg = plan.config
    splits = data_lib.open_splits(cfg.data, plan.tokenizer, plan.model_config.vocab_size,
                                  cfg.seed, progress=False)
    batch = next(data_lib.train_iterator(splits.train, cfg.seed, cfg.data.global_batch_size, 0))
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: llama.Llama(plan.model_config,
                                                                   rngs=nnx.Rngs(0))))[0], params)
    lp_jax.apply_recipe(model, plan.phases[0].recipe)  # the LM head's GEMM as the trainer's
    logits = nnx.jit(lambda m, b: m(b["tokens"], positions=b["positions"],
                                    segment_ids=b["segment_ids"]))(model, batch)
    nll, count = token_nll(logits, jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"]))
    return float(nll / count)


def test_init_hf_starts_from_the_export_with_a_fresh_optimizer(source, tmp_path, token_cache):
    config, root = source
    hf_dir = tmp_path / "hf"
    shutil.copytree(root / "hf", hf_dir)
    # steps=3 as the source (stop_at changes nothing else): the compiled step is reused.
    new = tiny(tmp_path / "new", token_cache, "steps=3", "stop_at=1", f"init.hf={hf_dir}",
               "model.preset=llama3_8b")  # the preset is not used: the weights decide
    plan = resolve(new)
    assert plan.model_config == resolve(config).model_config
    run(plan)
    # Step 1 (the loss before any update) is the source's loss at step 3 on that batch.
    _, src_state = _masters(config, 3)
    expected = _first_batch_loss(plan, src_state["params"])
    first = read_metrics(tmp_path / "new")[0]
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(first["loss"] - read_metrics(root / "src")[0]["loss"]) > 0.1  # not a fresh init
    # A fresh schedule (the first step at init_lr) and fresh Adam moments: after one step
    # from zero, mu = (1 - b1) g and nu = (1 - b2) g^2, so mu^2 = (1-b1)^2/(1-b2) nu everywhere;
    # moments carried over from the source would break that.
    assert first["lr"] == new.schedule.init_lr == 0.0
    _, state = _masters(new, 1)
    adam = state["opt_state"][1][0]
    assert int(adam.count) == 1 and int(state["opt_steps"]) == 1
    b1, b2 = new.optimizer.b1, new.optimizer.b2
    for mu, nu in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)):
        np.testing.assert_allclose(np.square(mu), (1 - b1) ** 2 / (1 - b2) * nu, rtol=1e-4,
                                   atol=1e-30)
    # lr 0 at step 1 leaves the weights exactly as exported.
    exported = _hf_files(hf_dir)
    flat = _flat_params(state)
    for name, path, transpose in tensor_map(plan.model_config):
        np.testing.assert_array_equal(flat[path], exported[name].T if transpose else exported[name])
    # The resumed run continues its own checkpoint: the source is never read again.
    shutil.rmtree(hf_dir)
    result = run(resolve(tiny(tmp_path / "new", token_cache, "steps=3", "stop_at=2",
                              f"init.hf={hf_dir}", "model.preset=llama3_8b")))
    assert result.step == 2 and [m["step"] for m in read_metrics(tmp_path / "new")] == [1, 2]
    # eval.py --checkpoint builds the model the checkpoint records, not the unused preset.
    loaded = loading.load_from_run_dir(str(tmp_path / "new"))
    assert loaded.source.endswith("@2") and loaded.model.config.num_layers == 4


def test_init_checkpoint_takes_another_runs_step(source, tmp_path, token_cache):
    config, root = source
    new = tiny(tmp_path / "new", token_cache, "steps=3", "stop_at=1",
               f"init.checkpoint={root / 'src'}@2")
    run(resolve(new))
    _, state = _masters(new, 1)
    _, step2 = _masters(config, 2)
    _, step3 = _masters(config, 3)
    got, want, latest = _flat_params(state), _flat_params(step2), _flat_params(step3)
    assert all(np.array_equal(got[p], want[p]) for p in want)  # lr 0 at step 1: untouched
    assert not all(np.array_equal(got[p], latest[p]) for p in latest)  # @2, not the latest


@pytest.mark.slow
def test_nvfp4_run_exports_its_fp32_masters(tmp_path, token_cache):
    config = tiny(tmp_path / "run", token_cache, "steps=2", "precision=nvfp4",
                  "precision.last_bf16_layers=1")
    run(resolve(config))
    plan, state = _masters(config, 2)
    masters = _flat_params(state)
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert export.main([str(tmp_path / "run"), str(out), "--dtype", dtype]) == 0
        exported = _hf_files(out)
        for name, path, transpose in tensor_map(plan.model_config):
            want = masters[path].T if transpose else masters[path]
            assert exported[name].tobytes() == want.astype(jnp.dtype(dtype)).tobytes(), name
    # Control: NVFP4-quantized weights differ from the masters, so a leak would show above.
    kernel = masters[("layers", 0, "attn", "q_proj", "kernel")]
    fp4 = lp_jax.dequantize(lp_jax.quantize(jnp.asarray(kernel), "nvfp4", axis=0, block_2d=True))
    assert not np.array_equal(np.asarray(fp4), kernel)


def _train_check(capsys, *overrides):
    """train.py --check with overrides: (exit status, stderr)."""
    status = cli.main(["--config", "configs/tiny.yaml", "--check", *overrides])
    return status, capsys.readouterr().err


def _edit(folder, **changes):
    path = os.path.join(folder, "config.json")
    config = {**json.load(open(path)), **changes}
    json.dump(config, open(path, "w"))


def test_bad_inputs_are_one_line_and_exit_2(source, tmp_path, capsys):
    _, root = source
    src, hf_dir = str(root / "src"), str(root / "hf")
    capsys.readouterr()
    # Export: a run folder without checkpoints, a step that does not exist, a preset.
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "empty_run" / "config.yaml").write_text("model: {preset: tiny}\n")
    for args, message in [
        ([str(tmp_path / "empty_run"), str(tmp_path / "o")], "empty_run: no checkpoints"),
        ([src, str(tmp_path / "o"), "--step", "7"], "no checkpoint of step 7; saved steps: 2, 3"),
        ([os.path.join(src, "checkpoints", "2"), str(tmp_path / "o"), "--step", "3"],
         "is the checkpoint of step 2, not step 3"),
    ]:
        assert export.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "o")
    # train.py: another architecture, another vocabulary, a step that does not exist.
    mistral = tmp_path / "mistral"
    shutil.copytree(hf_dir, mistral)
    _edit(mistral, architectures=["MistralForCausalLM"], model_type="mistral")
    other_tokenizer = tmp_path / "bpe"
    shutil.copytree(hf_dir, other_tokenizer)
    write_byte_level_tokenizer(other_tokenizer / "tokenizer.json")  # 320 BPE ids, not bytes
    run_dir = f"run_dir={tmp_path / 'new'}"
    for overrides, message in [
        ([f"init.hf={mistral}"], "unsupported architecture ['MistralForCausalLM']"),
        ([f"init.hf={UNTIED}"], "the weights have a vocabulary of 96 ids, fewer than the 259 "
                                "of data.tokenizer 'bytes'"),
        ([f"init.hf={other_tokenizer}"], "which encodes text differently from data.tokenizer "
                                         f"'bytes' (259 ids); set data.tokenizer=hf:{other_tokenizer}"),
        ([f"init.hf={hf_dir}", "model.hidden_size=256"],
         f"model.hidden_size=256 does not fit the weights of init.hf={hf_dir} (hidden_size 128)"),
        ([f"init.checkpoint={src}@9"], "no checkpoint of step 9; saved steps: 2, 3"),
        ([f"init.checkpoint={tmp_path / 'empty_run'}"], "no checkpoints"),
        ([f"init.hf={hf_dir}", f"init.checkpoint={src}"], "init.hf and init.checkpoint are both set"),
        ([f"init.hf={tmp_path / 'nowhere'}"], "nowhere: no such folder"),
    ]:
        status, err = _train_check(capsys, run_dir, *overrides)
        assert status == 2 and err.startswith("train.py: error: ") and err.count("\n") == 1, err
        assert message in err, err


def test_init_keeps_the_weights_architecture_and_set_keys(source, tmp_path, token_cache):
    config, root = source
    plan = resolve(tiny(tmp_path, token_cache, f"init.hf={root / 'hf'}", "model.rope_theta=20000",
                        "model.remat=full", "model.vocab_size=384"))
    assert plan.model_config == resolve(config).model_config.replace(rope_theta=20000.0,
                                                                      remat="full")
    with pytest.raises(UserError, match="must be <= model.max_seq_len=256"):
        resolve(tiny(tmp_path, token_cache, f"init.hf={root / 'hf'}", "data.seq_len=512"))
