"""One recipe of a plan, in a process of its own: ``python -m lp_jax.plan.worker REQUEST``
(JSON: config, overrides, recipe, gpu, gpus, hlo_dir, layer_bytes,
layer_cost) prints the row as the last line of
its output. A process per recipe keeps one compile's memory from the next, and an abort
inside XLA's compiler costs only that row."""
from __future__ import annotations

import json
import os
import sys

from lp_jax.plan.environment import deviceless


def main(argv: list[str] | None = None) -> int:
    request = json.loads((argv or sys.argv[1:])[0])
    deviceless()
    from lp_jax.config.yaml_io import load_config
    from lp_jax.errors import UserError, one_line
    from lp_jax.plan.compile_step import compile_step
    from lp_jax.plan.gpus import gpu as gpu_named
    from lp_jax.plan.layer_bytes import layer_bytes
    from lp_jax.plan.layer_cost import layer_cost
    from lp_jax.plan.rows import row
    from lp_jax.training.validate import resolve

    recipe = request["recipe"]
    try:
        config = load_config(request["config"], [*request["overrides"], f"precision.recipe={recipe}"])
        plan = resolve(config, device_count=request["gpus"], check_files=False)
        gpu = gpu_named(request["gpu"])
        step = compile_step(plan, gpu, request["gpus"])
        out = row(plan, gpu, request["gpus"], step)
        overrides, compiles = [*request["overrides"], f"precision.recipe={recipe}"], {}
        if request.get("layer_bytes"):
            per = layer_bytes(request["config"], overrides, gpu, request["gpus"], cache=compiles)
            out["layer_bytes"] = {"per_token_hidden": per.per_token_hidden, "seq_lens": list(per.seq_lens),
                                  "temp_bytes": per.temp_bytes}
        if request.get("layer_cost"):
            out["layer_cost"] = layer_cost(request["config"], overrides, gpu, request["gpus"],
                                           cache=compiles).as_dict()
        if request.get("hlo_dir"):
            with open(os.path.join(request["hlo_dir"], f"{recipe}.hlo.txt"), "w") as f:
                f.write(step.text)
    except UserError as e:
        out = {"recipe": recipe, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - XLA's compile errors: the row says why
        out = {"recipe": recipe, "error": f"compile failed: {type(e).__name__}: {one_line(e)}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
