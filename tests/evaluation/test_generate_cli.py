"""python -m lp_jax.evaluation.generate: sampling from a training run's checkpoint."""
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from lp_jax.evaluation import generate as generate_cli
from models.generate import generate
from models.llama import Llama, preset


def _run_dir(tmp_path):
    model = Llama(preset("tiny", num_layers=2, max_seq_len=64), rngs=nnx.Rngs(1))
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
    manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(nnx.state(model))))
    manager.wait_until_finished()
    manager.close()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"preset": "tiny", "num_layers": 2, "max_seq_len": 64}, "data": {"tokenizer": "bytes"}}))
    return model


def test_greedy_sample_from_a_run_dir_matches_the_model(tmp_path, capsys):
    model = _run_dir(tmp_path)
    assert generate_cli.main([str(tmp_path), "--prompt", "ab", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    from lp_jax.data.tokenizers import get_tokenizer
    tok = get_tokenizer("bytes")
    ids = [tok.bos_id] + tok.encode("ab")
    expected = generate(model, [ids], 5, eos_id=tok.eos_id)[0, len(ids):]
    assert printed == "ab" + tok.decode([int(t) for t in expected])


def test_missing_run_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert generate_cli.main([str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]
