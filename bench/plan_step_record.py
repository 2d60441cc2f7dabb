"""Writes bench/records/plan-8b-{gb200,h200}-step.json from the plan's JSON of each shipped
8B config.

    # for each {recipe} of bf16, fp8_cs, mxfp8, nvfp4:
    python -m lp_jax.plan --config configs/llama3_8b_{recipe}.yaml --gpu gb200 --gpus 8 \\
        --recipes {recipe} --json OUT/{recipe}.json data.source=mock model.vocab_size=128256
    python -m bench.plan_step_record OUT

    # H200: each config at micro-batch 2 with remat=mlp (OUT/<recipe>-2-mlp.json), and BF16
    # at 1 with remat=elementwise (OUT/bf16-1-elementwise.json): --gpu h200 and
    # data.micro_batch_size=MB model.remat=POLICY on the same command
    python -m bench.plan_step_record OUT --gpu h200

    # Qwen3-30B-A3B: configs/qwen3_30b_a3b_{recipe}.yaml on 8 GB200s, model.vocab_size=151936,
    # and MXFP8's with mesh.ep_dispatch_dtype=fp8 (OUT/mxfp8-fp8_dispatch.json)
    python -m bench.plan_step_record OUT --model qwen3_30b_a3b

Run it in the environment that compiled (the record stamps its JAX version). Each recipe is
its own compile, so "x BF16" is taken here: the estimated tokens per second over BF16's.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import yaml

from bench.results.writer import ROOT, write_record

RECIPES = ("bf16", "fp8_cs", "mxfp8", "nvfp4")
# Megatron Bridge's published GB200 throughput over its BF16 run (docs/bridge_parity.md).
BRIDGE_X_BF16 = {"bf16": "1.00", "fp8_cs": "1.33", "mxfp8": "1.32", "nvfp4": "1.59"}
COMMAND = ("python -m lp_jax.plan --config configs/llama3_8b_{recipe}.yaml --gpu gb200 --gpus 8 "
           "--recipes {recipe} data.source=mock model.vocab_size=128256")


def rows(folder: pathlib.Path) -> list[list[str]]:
    plans = {r: json.loads((folder / f"{r}.json").read_text())["rows"][0] for r in RECIPES}
    bf16_tokens = plans["bf16"]["estimate"]["tokens_per_s"]
    out = []
    for recipe, row in plans.items():
        config = yaml.safe_load((ROOT / f"configs/llama3_8b_{recipe}.yaml").read_text())
        memory, estimate = row["memory"], row["estimate"]
        out.append([recipe, f"{config['data']['micro_batch_size']}, {config['model']['remat']}",
                    f"{memory['per_gpu_bytes'] / 1e9:.1f}",
                    f"{1 - memory['per_gpu_bytes'] / memory['capacity_bytes']:.0%}",
                    f"{row['hbm_bytes'] / 1e12:.1f}", f"{estimate['tflops_per_gpu']:.0f}",
                    f"{estimate['tokens_per_s'] / bf16_tokens:.2f}", BRIDGE_X_BF16[recipe]])
    return out


H200_RUNS = ("bf16-2-mlp", "bf16-1-elementwise", "fp8_cs-2-mlp", "mxfp8-2-mlp", "nvfp4-2-mlp")


def h200_rows(folder: pathlib.Path) -> list[list[str]]:
    plans = {run: json.loads((folder / f"{run}.json").read_text())["rows"][0] for run in H200_RUNS}
    bf16_tokens = plans["bf16-2-mlp"]["estimate"]["tokens_per_s"]
    return [[row["recipe"], ", ".join(run.split("-")[1:]), f"{row['memory']['per_gpu_bytes'] / 1e9:.1f}",
             f"{row['estimate']['tflops_per_gpu']:.0f}", f"{row['estimate']['tokens_per_s'] / bf16_tokens:.2f}"]
            for run, row in plans.items()]


MOE_COMMAND = ("python -m lp_jax.plan --config configs/qwen3_30b_a3b_{recipe}.yaml --gpu gb200 --gpus 8 "
               "--recipes {recipe} data.source=mock model.vocab_size=151936")


# The 30B-A3B runs: each shipped config, and MXFP8's with the dispatch in FP8
# (OUT/mxfp8-fp8_dispatch.json: mesh.ep_dispatch_dtype=fp8 on MXFP8's command).
MOE_RUNS = {"bf16": "bf16", "fp8_cs": "fp8_cs", "mxfp8": "mxfp8", "nvfp4": "nvfp4",
            "mxfp8-fp8_dispatch": "mxfp8, FP8 dispatch"}


def moe_rows(folder: pathlib.Path) -> list[list[str]]:
    # The runs whose compile finished (a deviceless compile can be killed for memory).
    files = {r: json.loads((folder / f"{r}.json").read_text()) for r in MOE_RUNS if (folder / f"{r}.json").exists()}
    plans = {r: dict(f["rows"][0], gpus=f["gpus"]) for r, f in files.items() if "estimate" in f["rows"][0]}
    bf16_tokens = plans["bf16"]["estimate"]["tokens_per_s"]
    return [[MOE_RUNS[run], row["policy"], f"{row['memory']['per_gpu_bytes'] / 1e9:.1f}",
             f"{1 - row['memory']['per_gpu_bytes'] / row['memory']['capacity_bytes']:.0%}",
             f"{row['hbm_bytes'] / 1e12:.0f}", f"{row['collective_bytes'] / 1e12:.1f}",
             ", ".join(f"{lib} {n}" for lib, n in sorted(row["gemms"].items())),
             f"{row['estimate']['tflops_per_gpu']:.0f}", f"{row['estimate']['tokens_per_s'] / row['gpus']:.0f}",
             f"{row['estimate']['tokens_per_s'] / bf16_tokens:.2f}"]
            for run, row in plans.items()]


# Megatron Bridge's published Qwen3-30B-A3B row on 8 GB200s (its performance summary, 25.11
# NeMo container: MXFP8, GBS 512, MBS 4, EP 8, routing forced balanced), measured on GPUs.
BRIDGE_30B_A3B = ("Megatron Bridge (25.11 container, measured on 8 GB200s): MXFP8, global batch 512, "
                  "micro-batch 4, EP 8, routing forced balanced: 23766 tokens/s per GPU, 547 model "
                  "TFLOP/s per GPU; no BF16 row is published for this model on GB200.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path, help="where the plan wrote its JSON files")
    parser.add_argument("--gpu", choices=("gb200", "h200"), default="gb200")
    parser.add_argument("--model", choices=("llama3_8b", "qwen3_30b_a3b"), default="llama3_8b")
    args = parser.parse_args()
    if args.model == "qwen3_30b_a3b":
        path = write_record(
            "plan-30b-a3b-gb200-step", "Qwen3-30B-A3B, sequence 4096, the shipped configs on 8 GB200s",
            MOE_COMMAND, ["recipe", "policy", "GB per GPU (of 186)", "free", "HBM TB per step",
                          "collective TB per step", "GEMM launches per step", "TFLOP/s per GPU",
                          "tokens/s per GPU", "x BF16"],
            moe_rows(args.folder), "deviceless compile for 8 GB200s on a 2-core CPU machine", estimate=True,
            estimate_columns=["TFLOP/s per GPU", "tokens/s per GPU", "x BF16"],
            note="Expert parallelism over the 8 GPUs, micro-batch 1, remat full, scanned layers; expert "
                 "GEMMs costed under balanced routing (each group's window for an even share of the routed "
                 "rows). " + ("\"FP8 dispatch\": mesh.ep_dispatch_dtype=fp8 on MXFP8's command. "
                             if (args.folder / "mxfp8-fp8_dispatch.json").exists() else "")
                 + BRIDGE_30B_A3B)
        print(f"wrote {path.relative_to(ROOT)}")
        return
    if args.gpu == "h200":
        path = write_record(
            "plan-8b-h200-step", "Llama 3 8B, sequence 8192, the shipped configs on 8 H200s",
            COMMAND.replace("gb200", "h200") + " data.micro_batch_size=MB model.remat=POLICY",
            ["recipe", "micro-batch, remat", "GB per GPU (of 141)", "TFLOP/s per GPU", "x BF16"],
            h200_rows(args.folder), "deviceless compile for 8 H200s on a 2-core CPU machine", estimate=True,
            estimate_columns=["TFLOP/s per GPU", "x BF16"],
            note="Ratios are to BF16 at 2, mlp; each recipe's own config, as shipped.")
        print(f"wrote {path.relative_to(ROOT)}")
        return
    path = write_record(
        "plan-8b-gb200-step", "Llama 3 8B, sequence 8192, the shipped configs on 8 GB200s", COMMAND,
        ["recipe", "micro-batch, remat", "GB per GPU (of 186)", "free", "HBM TB per step",
         "TFLOP/s per GPU", "x BF16", "Bridge x BF16 (measured)"],
        rows(args.folder), "deviceless compile for 8 GB200s on a 2-core CPU machine", estimate=True,
        estimate_columns=["TFLOP/s per GPU", "x BF16"],
        note="Fused QKV and gate/up, per-rank amaxes and each config's param_gather, as shipped.")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
