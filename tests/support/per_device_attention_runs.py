"""models.sharding.per_device with the reference attention per device, on the meshes the
trainer builds (data with ZeRO-1's manual data shard_map, fsdp, tensor and their mixes):
the same values as the unsharded call. Run by tests/models/test_cudnn_attention.py."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from lp_jax.parallel.mesh import make_mesh
from lp_jax.parallel.partitioning import activation_rules
from models import cudnn_attention
from models.layers import attention_core
from models.llama import causal_document_mask
from models.sharding import per_device

B, T, N, K, H = 8, 16, 4, 2, 8
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (B, T, N, H))
k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in keys[1:])
ids = jnp.asarray(np.repeat(np.arange(B * 4).reshape(B, 4), 4, axis=1) % 3 + 1)


def local(q, k, v, ids):
    return attention_core(q, k, v, causal_document_mask(ids, q.shape[0], q.shape[1]))


want = local(q, k, v, ids)
AXES = [cudnn_attention.Q_AXES, cudnn_attention.KV_AXES, cudnn_attention.KV_AXES, cudnn_attention.ROW_AXES]
for data, fsdp, tensor in [(8, 1, 1), (2, 4, 1), (2, 1, 2), (1, 4, 2), (1, 1, 4), (2, 2, 2)]:
    mesh = make_mesh(data, fsdp, tensor, devices=jax.devices()[:data * fsdp * tensor])
    for manual in [(), ("data",) + tuple(a for a in ("fsdp", "expert", "tensor") if mesh.shape[a] == 1)]:
        def body(q, k, v, ids, manual=manual):
            with nnx.logical_axis_rules(activation_rules(manual)):
                return per_device(local, [q, k, v, ids], AXES, cudnn_attention.Q_AXES,
                                  together=(("heads", "kv_heads"),))

        if manual:
            rows = P("data")
            run = jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 4, out_specs=rows,
                                axis_names=set(manual), check_vma=False)
        else:
            run = body
        with jax.set_mesh(mesh):
            got = jax.jit(run)(q, k, v, ids)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
        print("ok", (data, fsdp, tensor), manual)
