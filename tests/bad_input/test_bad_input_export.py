"""The Hugging Face side's output folders and odd files (docs/bad_input.md, case 14):
`python -m lp_jax.export`, `python -m models.hf import|export` and `init.hf`.

An export is written whole (models/files.py): into a folder beside its target, swapped in
when complete, so no file of an earlier export outlives it and a failed write leaves the
target as it was; only an earlier export (its lp_jax_export.json marker) is replaced. A
target that cannot be used, and every JSON file that is not a JSON object, is one line
before any work."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from flax import nnx

from lp_jax import export
from lp_jax.training import cli
from models import hf_cli
from models.config import preset
from models.hf import save_hf
from models.llama import Llama
from tests.bad_input.test_bad_input_folders import _read_only_folder
from tests.models.test_hf import TIED
from tests.support import bad_input
from tests.support.bad_input import ROOT, only_line, truncate

# The shared trained run (stopped at step 4) and each test's copy of it, as fixtures here.
stopped_run, run = bad_input.stopped_run, bad_input.run

MARKER = "lp_jax_export.json"
HOST = socket.gethostname().split(".")[0] or "localhost"


def _umask() -> int:
    umask = os.umask(0o22)
    os.umask(umask)
    return umask


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _earlier_export(folder, *stale):
    """A folder as an earlier export left it: its marker and files the new one lacks."""
    folder.mkdir()
    (folder / MARKER).write_text('{"written_by": "python -m lp_jax.export"}')
    for name in stale:
        (folder / name).write_text("from the earlier export")
    return folder


def _contents(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _assert_written_whole(folder, names):
    """Exactly `names` (and the marker), every file with the mode a new file gets, the
    folder with a new folder's."""
    assert sorted(os.listdir(folder)) == sorted([*names, MARKER])
    umask = _umask()
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {
        name: oct(0o666 & ~umask) for name in [*names, MARKER]}
    assert oct(folder.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_an_export_replaces_an_earlier_export_whole(run, tmp_path, capsys):
    target = _earlier_export(tmp_path / "hf", "special_tokens_map.json", "tokenizer.json",
                             "model-00001-of-00002.safetensors")
    dead, alive = _dead_pid(), os.getppid()
    killed = tmp_path / f".hf.partial-{HOST}-{dead}"  # an export killed mid-way
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / f".hf.replaced-{HOST}-{dead}").mkdir()  # one killed while swapping
    running = tmp_path / f".hf.partial-{HOST}-{alive}"  # one still writing here
    running.mkdir()
    elsewhere = tmp_path / f".hf.partial-otherhost-{dead}"  # cannot be checked from here
    elsewhere.mkdir()

    assert export.main([str(run), str(target)]) == 0
    out, err = capsys.readouterr()
    assert f"exported {run} step 4 -> {target}" in out
    assert err == (f"warning: left {elsewhere}: written by process {dead} on host otherhost, "
                   "which may still be running there; remove it if not\n")
    _assert_written_whole(target, ["config.json", "model.safetensors", "tokenizer.json",
                                   "tokenizer_config.json"])
    assert json.loads((target / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert json.loads((target / MARKER).read_text()) == {
        "written_by": "python -m lp_jax.export", "source": str(run), "step": 4, "dtype": "float32"}
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", "run", running.name, elsewhere.name])


@pytest.fixture(scope="module")
def state_checkpoint(tmp_path_factory):
    """`python -m models.hf import` of the tied, sharded fixture."""
    ckpt = tmp_path_factory.mktemp("state") / "ckpt"
    assert hf_cli.main(["import", str(TIED), str(ckpt)]) == 0
    return ckpt


def test_models_hf_export_replaces_an_earlier_export_whole(state_checkpoint, tmp_path, capsys):
    target = _earlier_export(tmp_path / "hf", "model.safetensors", "tokenizer.json")
    killed = tmp_path / f".hf.partial-{HOST}-{_dead_pid()}"
    killed.mkdir()
    args = ["export", str(state_checkpoint), str(target), "--max-shard-size", "20KB",
            "--dtype", "bfloat16"]
    assert hf_cli.main(args) == 0
    assert capsys.readouterr().err == ""
    _assert_written_whole(target, ["config.json", "model.safetensors.index.json",
                                   *(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3))])
    assert json.loads((target / MARKER).read_text())["source"] == str(state_checkpoint)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def _empty_run(tmp_path):
    """A run folder with no checkpoint: the export would fail on it once it read it."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.yaml").write_text("model: {preset: tiny}\n")
    return folder


def _tree(folder) -> dict:
    """Every path under `folder` (hidden ones too): a file's bytes, None for a folder."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


# Each command with a source it refuses once it reads it ("no checkpoints", "missing file
# llama_config.json", "missing file config.json"): an output refused first is refused
# before any work.
COMMANDS = {
    "lp_jax.export": (lambda src, out: export.main([str(src), out]), "hf_dir"),
    "models.hf export": (lambda src, out: hf_cli.main(["export", str(src), out]), "hf_dir"),
    "models.hf import": (lambda src, out: hf_cli.main(["import", str(src / "none"), out]),
                         "ckpt_dir"),
}
NOT_EMPTY = {
    "hf_dir": "holds files and is not an earlier export (it has no lp_jax_export.json); "
              "choose a new or empty folder",
    "ckpt_dir": "is not empty; choose a new folder",
}


@pytest.mark.parametrize("where", ["file", "under_file", "not_an_export", "read_only"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_output_that_cannot_be_used_is_refused_before_any_work(command, where, tmp_path,
                                                                  capsys):
    main, role = COMMANDS[command]
    src, base = _empty_run(tmp_path), tmp_path / "taken"
    target = base / "out" if where == "under_file" else base
    if where == "not_an_export":
        base.mkdir()
        (base / "notes.txt").write_text("mine")
    elif where == "read_only":
        if _read_only_folder() is None:
            pytest.skip("no folder this user cannot write")
        target = os.path.join(_read_only_folder(), "lp_jax_out")
    else:
        base.write_text("not a folder")
    before = _tree(tmp_path)
    assert main(src, str(target)) == 2
    line = only_line(capsys.readouterr().err, "error: ")
    if where == "read_only":
        assert line.startswith(f"error: {role}: cannot write in '{_read_only_folder()}' (")
        assert not os.path.exists(target)
    else:
        assert line == {
            "file": f"error: {role}: '{base}' is a file, not a folder",
            "under_file": f"error: {role}: '{base}' is a file, so '{target}' cannot be a folder",
            "not_an_export": f"error: {role}: '{base}' {NOT_EMPTY[role]}",
        }[where]
    assert _tree(tmp_path) == before  # no partial folder, nothing made or changed


def _in_tmpfs(disk, script, kib):
    """`script` run where `disk` is a fresh tmpfs of `kib` KiB (a user and mount namespace,
    so neither root nor a real mount is needed); skips where that cannot be made."""
    disk.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {disk}"],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace: {probe and probe.stderr.strip()}")
    return subprocess.run(["unshare", "-rm", "sh", "-c",
                           f"mount -t tmpfs -o size={kib}k tmpfs {disk} && {script}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_an_export_to_a_full_disk_leaves_the_earlier_export(run, tmp_path):
    """The real command onto a 200 KiB disk that holds an earlier export: the new one
    (about 1.3 MB of weights) does not fit."""
    old = _earlier_export(tmp_path / "old", "config.json", "tokenizer.json")
    disk, after = tmp_path / "disk", tmp_path / "after"
    proc = _in_tmpfs(disk, f"cp -a {old} {disk}/hf && "
                           f"{sys.executable} -m lp_jax.export {run} {disk}/hf; status=$?; "
                           f"cp -a {disk} {after} && exit $status", kib=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (f"error: hf_dir: cannot write '{disk}/hf': No space left on device "
                           "(errno 28); it is left as it was\n")
    assert sorted(os.listdir(after)) == ["hf"]  # no partial folder left
    assert _contents(after / "hf") == _contents(old)


def _hf_folder(path):
    """A tiny sharded Llama folder whose vocabulary takes the byte tokenizer (259 ids)."""
    cfg = preset("tiny", vocab_size=259, num_layers=1, hidden_size=32, intermediate_size=64,
                 num_heads=2, num_kv_heads=1, head_dim=16)
    save_hf(Llama(cfg, rngs=nnx.Rngs(0)), str(path), max_shard_size="20KB")
    return path


def _damage(path, content):
    """`content` written over the file, or the file cut to half its length (None)."""
    if content is None:
        truncate(path)
    else:
        path.write_bytes(content)


TRUNCATED = "is not valid JSON (truncated?): "
HF_FOLDER_DAMAGE = {
    "config.json an array": ("config.json", b"[1, 2]", "holds an array, not a JSON object"),
    "config.json a string": ("config.json", b'"x"', "holds a string, not a JSON object"),
    "config.json binary": ("config.json", b"\xff\xfe{", "is not valid JSON: it is not UTF-8 text"),
    "truncated index": ("model.safetensors.index.json", None, TRUNCATED),
    "index without a map": ("model.safetensors.index.json", b'{"weight_map": [1]}',
                            "has no weight_map of tensor names to file names"),
}


@pytest.mark.parametrize("damage", list(HF_FOLDER_DAMAGE))
def test_odd_json_in_an_hf_folder_is_one_line(damage, tmp_path, capsys):
    name, content, message = HF_FOLDER_DAMAGE[damage]
    folder = _hf_folder(tmp_path / "hf")
    file = folder / name
    _damage(file, content)
    assert hf_cli.main(["import", str(folder), str(tmp_path / "ckpt")]) == 2
    line = only_line(capsys.readouterr().err, "error: ")
    assert line.startswith(f"error: {file} {message}")
    rc, err = cli.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--check",
                        f"run_dir={tmp_path / 'new'}", f"init.hf={folder}"]), capsys.readouterr().err
    assert rc == 2
    assert only_line(err).startswith(f"train.py: error: init.hf={folder}: {file} {message}")
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no checkpoint, no run folder


STATE_DAMAGE = {
    "llama_config.json an array": ("llama_config.json", b"[1]", "holds an array, not a JSON object"),
    "llama_config.json of bad values": ("llama_config.json", b'{"hidden_size": [1]}',
                                        "does not describe a model: "),
    "truncated hf_config.json": ("hf_config.json", None, TRUNCATED),
}


@pytest.mark.parametrize("damage", list(STATE_DAMAGE))
def test_odd_json_in_a_state_checkpoint_is_one_line(damage, state_checkpoint, tmp_path, capsys):
    name, content, message = STATE_DAMAGE[damage]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(state_checkpoint, ckpt)
    _damage(ckpt / name, content)
    assert hf_cli.main(["export", str(ckpt), str(tmp_path / "hf")]) == 2
    line = only_line(capsys.readouterr().err, "error: ")
    assert line.startswith(f"error: {ckpt / name} {message}")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_import_to_a_full_disk_is_one_line(tmp_path):
    """`python -m models.hf import` onto a disk too small for the state checkpoint: the
    error line alone (Orbax's save threads would log it with tracebacks, several times)."""
    source = ROOT / "tests" / "fixtures" / "hf" / "llama3_untied_f32"
    disk = tmp_path / "disk"
    proc = _in_tmpfs(disk, f"{sys.executable} -m models.hf import {source} {disk}/ckpt", kib=32)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (f"error: ckpt_dir: cannot write '{disk}/ckpt': No space left on device "
                           "(errno 28); it was not created\n"), proc.stderr[-3000:]
