"""A checkpoint saved on mesh (data 2, fsdp 4) resumes on (fsdp 8): Orbax reads each
device's slices of the saved arrays into the new shardings (8 forced CPU devices, so in a
subprocess), and the resumed run continues the uninterrupted one.

XLA's excess precision is off, as in test_sharded_training.py: a data axis makes the step
another program (a shard_map around the micro-batch loop), and with XLA's default XLA:CPU
keeps other BF16 intermediates in FP32 in each, which alone moved the two resumed losses by
1.5e-5 and 2.2e-5."""
import json

import numpy as np
import pytest

from tests.support.forced_devices import run_python

SCRIPT = r'''
import json, sys
import jax, numpy as np
from flax import nnx
from lp_jax.runs.checkpoint import Checkpointer, abstract_like
from lp_jax.config.yaml_io import load_config
from lp_jax.training.loop import run
from lp_jax.training.metrics import read_metrics
from lp_jax.training.optimizer import OptimizerSpec, make_optimizer
from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import state_shardings
from lp_jax.training.state import abstract_state, split_model
from lp_jax.training.validate import resolve
from models import llama

tmp = sys.argv[1]
common = ["model.preset=tiny", "model.num_layers=2", "steps=5", "data.source=mock", "data.seq_len=32",
          "data.global_batch_size=8", "data.micro_batch_size=1", "logging.val_batches=0",
          "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.async_save=false",
          "schedule.warmup_steps=2"]
def plan(run_dir, data, fsdp, *extra):
    return resolve(load_config(None, [f"run_dir={run_dir}", f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                                      *common, *extra]))
run(plan(f"{tmp}/moved", 2, 4, "stop_at=3"))          # saves step 3 on (2, 4, 1)
# The saved state read back on both meshes: the same values, the new mesh's shardings.
ckpt = Checkpointer(f"{tmp}/moved/checkpoints", 3)
states = {}
for shape in ((2, 4, 1), (1, 8, 1)):
    mesh = make_mesh(*shape)
    p = plan(f"{tmp}/moved", *shape[:2])
    tx = make_optimizer(OptimizerSpec.from_config(p.config))
    model = nnx.eval_shape(lambda: llama.Llama(p.model_config, rngs=nnx.Rngs(0)))
    target = abstract_state(split_model(model), tx, 0)
    state, _ = ckpt.restore(3, abstract_like(target, state_shardings(target, mesh)), None)
    states[shape] = state
ckpt.close()
a, b = (jax.tree.leaves(states[s]) for s in ((2, 4, 1), (1, 8, 1)))
same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
shard = lambda s: list(states[s]["params"]["layers"][0]["attn"]["q_proj"]["kernel"].addressable_shards[0].data.shape)
print(json.dumps({"restored_equal": same, "q_shard_before": shard((2, 4, 1)), "q_shard_after": shard((1, 8, 1))}))
run(plan(f"{tmp}/moved", 1, 8))                        # resumes on (1, 8, 1), steps 4-5
run(plan(f"{tmp}/straight", 2, 4))                     # uninterrupted on (2, 4, 1)
print(json.dumps({name: [m["loss"] for m in read_metrics(f"{tmp}/{name}")] for name in ("moved", "straight")}))
'''


@pytest.mark.slow
def test_checkpoint_from_one_mesh_resumes_on_another(tmp_path):
    proc = run_python(["-c", SCRIPT, str(tmp_path)], xla_flags="--xla_allow_excess_precision=false")
    assert "resumed from step 3" in proc.stderr + proc.stdout
    restored, losses = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert restored["restored_equal"], "the state read on (1, 8, 1) differs from the one saved on (2, 4, 1)"
    assert restored["q_shard_before"] == [32, 128] and restored["q_shard_after"] == [16, 128]
    moved, straight = np.array(losses["moved"]), np.array(losses["straight"])
    print("relative differences after the move:", np.abs(moved / straight - 1))
    assert len(moved) == len(straight) == 5
    np.testing.assert_array_equal(moved[:3], straight[:3])  # the same run up to the save
    np.testing.assert_allclose(moved[3:], straight[3:], rtol=1e-5)  # then another mesh
