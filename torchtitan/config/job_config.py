"""The job configuration: one dataclass per TOML section.

Every field carries a one-line doc (``doc=``) that doubles as its ``--help`` text.
Field names follow what users of TorchTitan-style trainers already type.
"""

from dataclasses import dataclass
from typing import Literal

from torchtitan.config_fields import option, section
from torchtitan.data.config import Chat, Data, DataLoader


@dataclass
class Job:
    config_file: str | None = option(None, "TOML file to read; CLI flags override it")
    dump_folder: str = option("./outputs", "Local folder for metrics, the resolved config, traces and checkpoints")
    description: str = option("", "Free-text description of the run")
    print_config: bool = option(False, "Print the resolved config at start")
    save_config_file: str = option("config.toml", "File name (in dump_folder) the resolved config is saved to")


@dataclass
class Profiling:
    enable_profiling: bool = option(False, "Record torch.profiler traces")
    save_traces_folder: str = option("profile_traces", "Trace folder, relative to dump_folder")
    profile_freq: int = option(10, "Record a trace every this many steps")
    enable_memory_snapshot: bool = option(False, "Record memory snapshots where the device supports them")
    save_memory_snapshot_folder: str = option("memory_snapshot", "Snapshot folder, relative to dump_folder")


@dataclass
class Metrics:
    log_freq: int = option(10, "Log metrics every this many steps (step 1 and the last step are always logged)")
    enable_tensorboard: bool = option(False, "Write TensorBoard event files")
    save_tb_folder: str = option("tb", "TensorBoard folder, relative to dump_folder")
    enable_wandb: bool = option(False, "Log to Weights & Biases (WANDB_MODE=offline writes the run to disk)")
    wandb_project: str | None = option(None, "W&B project (default: $WANDB_PROJECT, else 'torchtitan')")
    wandb_run_name: str | None = option(None, "W&B run name (default: $WANDB_NAME, else the dump folder's name)")
    disable_color_printing: bool = option(False, "Print the console metrics line without colors")
    save_for_all_ranks: bool = option(False, "Write metrics from every rank, not only rank 0")
    peak_tflops: float | None = option(
        None, "Peak TFLOP/s of one device for MFU; overrides the GPU table and the CPU calibration"
    )


@dataclass
class Mup:
    base_width: int = option(
        0, "µP: the width (model dim) of the base model the hyper-parameters were tuned on; this model's init, "
        "logits, attention scale and per-group learning rates follow from the ratio (docs/mup.md); 0: off")
    base_head_dim: int = option(
        0, "µP: the base model's attention head size; 0: this model's own (a width grown by adding heads)")


@dataclass
class Model:
    name: str = option("llama3", "Registered model (TrainSpec) name")
    flavor: str = option("debugmodel", "Model size/variant within the family, or \"hf:<folder>\": the family's "
                                       "model at the dimensions of the Hugging Face config.json in that folder")
    hf_assets_path: str = option("assets/tokenizer", "Folder holding the tokenizer (and HF config/weights)")
    attention_mask: Literal["auto", "causal", "block_causal"] = option(
        "auto", "causal: attend to every earlier token of the row; block_causal: only to earlier tokens of the "
        "same document; auto: block_causal for chat data, else causal"
    )
    positions: Literal["auto", "global", "per_document"] = option(
        "auto", "RoPE positions: global (0..seq_len-1 along the row) or per_document (restart at each document; "
        "one cut by the row's start counts from 0 there); auto: per_document for chat data, else global"
    )
    mtp_depth: int | None = option(
        None, "Multi-token prediction blocks trained after the main ones (deepseek_v3; block k predicts the token "
        "k + 1 places ahead, as DeepSeek-V3 does with 1): unset = the flavor's, 0 = off"
    )
    converters: list[str] = option([], "Model converters applied in order: float8, lora")
    print_after_conversion: bool = option(False, "Print the model after converters ran")
    mup: Mup = section(Mup, "µP (maximal update parametrization): tune at a small width, train at a larger one")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon", "AdamW8bit", "SGD"] = option(
        "AdamW", "Optimizer; Muon updates the hidden matrices and AdamW (these betas, eps) the other parameters; "
        "AdamW8bit keeps AdamW's moments in 8 bits (torchao); SGD: plain gradient descent (no momentum)")
    lr: float = option(8e-4, "Peak learning rate")
    beta1: float = option(0.9, "Adam beta1")
    beta2: float = option(0.95, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon")
    weight_decay: float = option(0.1, "Weight decay (decoupled for AdamW and Muon)")
    implementation: Literal["fused", "foreach", "for-loop"] = option(
        "fused", "Optimizer kernel implementation (for Muon: of its AdamW group; AdamW8bit compiles its own)")
    state_dtype: Literal["float32", "bfloat16"] = option(
        "float32", "dtype the optimizer keeps its moments (Muon: momentum) in; the update math runs in float32 either "
        "way; float32 keeps them as PyTorch does, in the parameters' dtype (training.dtype)")
    muon_momentum: float = option(0.95, "Muon: momentum of the gradient average that is orthogonalised")
    muon_nesterov: bool = option(True, "Muon: orthogonalise the Nesterov look-ahead instead of the momentum buffer")
    muon_ns_steps: int = option(5, "Muon: Newton-Schulz iterations")
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = option(
        "match_rms_adamw", "Muon: lr per matrix; match_rms_adamw: lr * 0.2 * sqrt(max(rows, cols)), so AdamW's lr and "
        "weight decay carry over; original: lr * sqrt(max(1, rows / cols))")
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto", "Muon: dtype of the Newton-Schulz matmuls; auto: bfloat16 where it is fast (GPUs, CPUs with AMX or "
        "AVX-512 BF16), else float32")
    early_step_in_backward: bool = option(False, "Step each parameter as soon as its gradient is ready")
    qk_clip_threshold: float = option(
        0.0, "QK-clip (MuonClip): after each step, scale the query/key weights of every attention head whose largest "
        "logit of the step exceeded this, back to it (0: off; not for QK-norm families)")


@dataclass
class LRScheduler:
    warmup_steps: int = option(200, "Steps of linear warmup from lr/warmup_steps to lr")
    decay_ratio: float | None = option(
        None, "Fraction of the post-warmup steps spent decaying (None: decay right after warmup)"
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = option("linear", "Shape of the decay")
    min_lr_factor: float = option(0.0, "Final lr as a fraction of the peak lr")


@dataclass
class Guard:
    enable: bool = option(False, "Skip the optimizer step when the gradient norm or loss is not finite, or the loss "
                                 "spikes; skipped steps are counted (guard/skipped_steps)")
    spike_factor: float = option(5.0, "A loss above this x the median of the last `window` kept steps is a spike "
                                      "(0: only non-finite steps are skipped)")
    window: int = option(50, "Kept steps in the running median; spikes are looked for once it is full")
    max_consecutive: int = option(5, "Stop the run when more than this many steps in a row are skipped")


@dataclass
class Training:
    dataset: str = option(
        "pydocs", "Registered dataset: pydocs, c4, c4_validation, fineweb-edu, wikitext-103 (text); pydocs_chat (chat)"
    )
    dataset_format: Literal["text", "chat", "tokens"] = option(
        "text", "text: documents packed end to end; chat: conversations rendered with the tokenizer's chat "
        "template, trained per training.chat; tokens: dataset_path is a folder of scripts/tokenize_dataset.py shards"
    )
    shuffle_documents: bool = option(
        False, "tokens format: read the documents in a permutation drawn per pass from debug.seed (else stored order)"
    )
    dataset_path: str | None = option(
        None, "json/jsonl/parquet/arrow/txt file or folder, local or a URL (s3://...); used instead of "
              "training.dataset when set"
    )
    dataset_text_column: str = option("text", "Column holding the text in training.dataset_path files")
    local_batch_size: int = option(8, "Sequences per micro-batch on each data-parallel rank")
    global_batch_size: int = option(
        -1, "Sequences per optimizer step over all ranks (-1 = local x dp, no accumulation)"
    )
    seq_len: int = option(2048, "Tokens per sequence")
    max_norm: float = option(1.0, "Clip the global gradient norm to this value (<= 0 disables)")
    loss_chunk_size: int = option(
        0, "Compute the output projection and cross-entropy over chunks of this many tokens, so the full logits "
        "never exist at once (0: the plain path)"
    )
    mtp_loss_weight: float = option(
        0.3, "Weight of the multi-token prediction loss (mean over its depths) added to the main-token loss, constant "
        "over the run (DeepSeek-V3 used 0.3, then 0.1 late in training: set it per stage of training)"
    )
    objective: str = option(
        "next_token", "Registered training objective: next_token (plus the multi-token prediction loss where the "
        "model has its blocks), grpo (reinforcement learning on the policy's own rollouts, [rl]); a module of "
        "experimental.custom_import can register more (components/objectives/objective.py)"
    )
    steps: int = option(10000, "Optimizer steps to train")
    enable_cpu_offload: bool = option(False, "Offload parameters, gradients and optimizer state to CPU (FSDP)")
    dtype: Literal["float32", "bfloat16"] = option("float32", "Dtype the parameters are stored in")
    mixed_precision_param: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", "Dtype the forward/backward computes in (auto: bfloat16 on GPUs and on CPUs with AMX or "
        "AVX-512 BF16, else float32)"
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = option("float32", "Dtype gradients are reduced in")
    gc_freq: int = option(50, "Run Python garbage collection every this many steps")
    dataloader: DataLoader = section(DataLoader, "Data loader settings")
    chat: Chat = section(Chat, "Chat (supervised fine-tuning) data settings")
    guard: Guard = section(Guard, "Bad-step guard: skip steps with non-finite gradients or loss spikes")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = option(1, "Replicas (DDP, or HSDP with sharding)")
    data_parallel_shard_degree: int = option(-1, "FSDP shards (-1 = the ranks left over)")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = option(
        "default", "Free gathered parameters after forward"
    )
    tensor_parallel_degree: int = option(1, "Tensor-parallel degree")
    disable_loss_parallel: bool = option(False, "Gather logits before the loss under TP")
    enable_async_tensor_parallel: bool = option(False, "Overlap TP communication (needs compile on CUDA)")
    pipeline_parallel_degree: int = option(1, "Pipeline stages")
    pipeline_parallel_schedule: str = option(
        "1F1B", "Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
        "DualPipeV")
    pipeline_parallel_schedule_csv: str | None = option(
        None, "CSV of a custom schedule (one row of actions like 0F1, 1B0 per pp rank); overrides the schedule name")
    pipeline_parallel_microbatch_size: int = option(1, "Sequences per pipeline micro-batch")
    pipeline_parallel_layers_per_stage: int | None = option(
        None, "Layers per pipeline stage, counting the embedding and output as layers (sets the stage count)")
    module_fqns_per_model_part: list[list[str]] | None = option(
        None, "Module names of each pipeline stage: [['tok_embeddings', 'layers.0'], ['layers.1', 'norm', 'output']] "
        "in TOML, 'tok_embeddings,layers.0;layers.1,norm,output' on the command line")
    pipeline_parallel_first_stage_less_layers: int = option(1, "Layers the first stage gives up (embedding)")
    pipeline_parallel_last_stage_less_layers: int = option(1, "Layers the last stage gives up (output)")
    context_parallel_degree: int = option(1, "Context-parallel degree (sequence sharding)")
    context_parallel_rotate_method: Literal["allgather", "ring"] = option(
        "allgather", "How K/V reach the other context-parallel ranks: allgather (once per layer) or ring (send/recv)"
    )
    expert_parallel_degree: int = option(
        1, "Expert-parallel degree: a MoE's experts are split over this many of the dp_shard x cp ranks")


@dataclass
class MoE:
    bias_update_rate: float = option(
        1e-3, "Auxiliary-loss-free balancing: after each step every expert's routing bias moves this much toward "
        "the mean load, from the step's token counts over all ranks (0 = off)")
    aux_loss_coeff: float = option(0.0, "Weight of the auxiliary load-balancing loss added to the training loss "
                                   "(0 = off)")
    aux_loss_type: Literal["sequence", "batch"] = option(
        "sequence", "Auxiliary loss per sequence (averaged over the global batch) or per micro-batch of a rank")
    router_dtype: Literal["float32", "compute"] = option(
        "float32", "Dtype the router's gate computes in (compute: training.mixed_precision_param)")
    expert_compute: Literal["auto", "grouped", "loop"] = option(
        "auto", "How routed experts compute: one grouped GEMM, a loop over the experts, or auto (the faster of "
        "the two on this device and dtype, timed within ~3 s; cached when the margin is beyond the noise)")


@dataclass
class Checkpoint:
    enable: bool = option(False, "Save and load checkpoints")
    folder: str = option("checkpoint", "Checkpoint folder, relative to dump_folder; an absolute path or a URL "
                         "(s3://, gs://, file://, ...) is used as is")
    interval: int = option(500, "Save every this many steps")
    initial_load_path: str | None = option(None, "Checkpoint (folder or URL) to start from when the run has none")
    initial_load_model_only: bool = option(True, "Load only model weights from initial_load_path")
    initial_load_in_hf: bool = option(False, "initial_load_path holds HF safetensors")
    last_save_model_only: bool = option(True, "At the last step also export the model weights only, to "
                                        "export-step-N/ beside step-N/")
    last_save_in_hf: bool = option(False, "Write that export as a Hugging Face folder (config.json, "
                                   "model.safetensors, tokenizer files) that transformers loads; needs "
                                   "last_save_model_only and a model with a state_dict_adapter")
    export_dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "Dtype of model-only exports")
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = option(
        "disabled", "Write checkpoints in the background"
    )
    keep_latest_k: int = option(10, "Keep this many latest checkpoints (0 = all)")
    load_step: int = option(-1, "Step to load (-1 = latest). Below the newest checkpoint the run refuses to start "
                            "(its saves would overwrite or prune the newer ones): copy that step into a new "
                            "checkpoint.folder to branch, or set discard_newer_steps")
    discard_newer_steps: bool = option(False, "With load_step below the newest checkpoint: delete the newer "
                                       "checkpoints and exports once load_step's is loaded, instead of refusing")
    exclude_from_loading: list[str] = option([], "State keys not to load, e.g. optimizer,dataloader")
    enable_first_step_checkpoint: bool = option(False, "Save right after step 1")
    create_seed_checkpoint: bool = option(False, "Write the initial weights as step-0 (model only) and exit "
                                          "without training; one process only. Later runs with checkpoint.enable "
                                          "start from it under any layout")
    load_only: bool = option(False, "Load checkpoints but never save")
    hf_drop_expert_bias: bool = option(
        False, "Hugging Face exports of a MoE whose format has no routing bias drop the trained expert bias "
        "(the largest value dropped is logged) instead of refusing")
    hf_include_mtp: bool = option(
        False, "Hugging Face exports also hold the multi-token prediction blocks, as model.layers.{n_layers + k}.* "
        "(DeepSeek-V3's released layout; transformers does not run them); else they are left out")


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "none"] = option("selective", "Activation checkpointing mode")
    selective_ac_option: str = option("2", "Checkpoint every N-th block (an integer) or 'op' for per-operator")
    preserve_rng_state: bool = option(False, "Replay the RNG state during recomputation")


@dataclass
class Compile:
    enable: bool = option(False, "Compile with torch.compile")
    components: list[Literal["model", "loss"]] = option(["model", "loss"], "What to compile")
    backend: str = option("inductor", "torch.compile backend")


@dataclass
class Float8:
    enable_fsdp_float8_all_gather: bool = option(False, "All-gather FSDP parameters in float8")
    precompute_float8_dynamic_scale_for_fsdp: bool = option(False, "Compute float8 scales once per step")
    recipe_name: Literal["tensorwise", "rowwise"] | None = option(None, "float8 scaling recipe")
    filter_fqns: list[str] = option(["output"], "Linear layers (by name) left in high precision")
    emulate: Literal["auto", True, False] = option(
        "auto", "Round to float8 but multiply in high precision; auto: where the device has no fast float8 matmul "
        "(CPUs, and CUDA GPUs before compute capability 8.9 other than AMD MI300/MI350), which would run float8 "
        "matmuls thousands of times slower; false: float8 matmuls (torch._scaled_mm) wherever it runs")


@dataclass
class QuantizeLinear:
    float8: Float8 = section(Float8, "float8 training of Linear layers")


@dataclass
class Quantize:
    linear: QuantizeLinear = section(QuantizeLinear, "Linear-layer quantization")


@dataclass
class LoRA:
    rank: int = option(8, "LoRA: rank r of each adapter (A is r x in_features, B is out_features x r)")
    alpha: float = option(16.0, "LoRA: the adapter's output is scaled by alpha / rank")
    dropout: float = option(0.0, "LoRA: dropout probability on the adapter's input")
    targets: list[str] = option(
        ["attention.*"], "LoRA: Linear layers to adapt, as patterns on names within a block, e.g. attention.wq, "
        "attention.*, feed_forward.*, moe.shared_experts.*")
    train_base: bool = option(False, "LoRA: train the base weights too (by default they are frozen: no gradient, "
                                     "no optimizer state, not in checkpoints)")
    base_dtype: Literal["model", "nf4"] = option(
        "model", "LoRA: how the frozen base's Linear weights are stored: model = training.dtype; nf4 = 4-bit "
        "NormalFloat with double-quantised scales (QLoRA, torchao), dequantised per matmul in the compute dtype")
    adapter_path: str | None = option(
        None, "LoRA: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start the adapters "
        "from instead of A random, B zero; the run's own checkpoints, once it has some, take precedence")


@dataclass
class Comm:
    init_timeout_seconds: int = option(300, "Timeout for the first collective (process group start)")
    train_timeout_seconds: int = option(100, "Timeout for collectives after the first step")


@dataclass
class Observability:
    record_phases: bool = option(
        True, "Time each step's phases on every rank (data, forward_backward, grad_comm, optimizer, logging, "
        "evaluation, checkpoint) into {dump_folder}/timeline/rank{N}.jsonl and gather min/median/max every log step")
    max_file_mb: float = option(64.0, "A rank's timeline file is rotated to rank{N}.jsonl.1 beyond this size (MB)")
    trace_steps: int = option(20, "Steps the Chrome trace timeline/trace_rank{N}.json holds (the last ones)")
    straggler_fraction: float = option(
        0.2, "A rank is behind at a step when it reaches a phase's end later than the median rank by this "
        "fraction of the median step time")
    straggler_steps: int = option(3, "Consecutive steps behind before a rank is named a straggler")
    hang_watchdog: bool = option(True, "Write every thread's stack when training makes no progress within the hang timeout")
    hang_timeout_seconds: float = option(
        0.0, "Seconds without progress before the watchdog fires; 0: 10x the median step, at least 30 s and at most "
        "0.8x comm.train_timeout_seconds; either way at most comm.train_timeout_seconds - 6 (its 1 s poll and 5 s "
        "NCCL dump must end before the collective timeout ends the job without stacks)")
    hang_exit: bool = option(False, "End the job after writing the stacks, so a scheduler can requeue it")


@dataclass
class Validation:
    enable: bool = option(False, "Run validation during training")
    dataset: str = option("pydocs", "Registered dataset used for validation (its validation split)")
    dataset_format: Literal["text", "chat", "tokens"] = option(
        "text", "text, chat (conversations read and packed as training.chat says; loss on trained tokens only) "
        "or tokens (dataset_path: a folder of pre-tokenized shards)"
    )
    dataset_path: str | None = option(
        None, "Validation file or folder, local or a URL (all of it is held out); used instead of "
              "validation.dataset when set"
    )
    dataset_text_column: str = option("text", "Column holding the text in validation.dataset_path files")
    local_batch_size: int = option(8, "Validation sequences per rank per step")
    seq_len: int = option(2048, "Validation sequence length")
    freq: int = option(10, "Validate every this many training steps")
    steps: int = option(-1, "Validation steps (-1 = the whole split)")


@dataclass
class SemiSync:
    method: Literal["none", "diloco"] = option(
        "none", "none: the groups average their gradients every step; diloco: each group takes sync_every steps of "
        "its own optimizer, then the groups average their weight changes and take one outer step (DiLoCo)")
    sync_every: int = option(20, "DiLoCo: inner steps between synchronisations (H)")
    outer_lr: float = option(0.7, "DiLoCo: learning rate of the outer SGD on the averaged weight change")
    outer_momentum: float = option(0.9, "DiLoCo: Nesterov momentum of the outer SGD (0: plain SGD)")
    fragments: int = option(
        1, "DiLoCo: parts of the model (runs of consecutive blocks) synchronised in turn, each every sync_every steps "
        "(Streaming DiLoCo); sync_every must be a multiple")


@dataclass
class FaultTolerance:
    enable: bool = option(
        False, "Train as one of several replica groups that fail and rejoin without stopping the others (torchft); "
        "the lighthouse's address comes from $TORCHFT_LIGHTHOUSE")
    replica_id: int = option(0, "This replica group's index, 0 .. group_size - 1")
    group_size: int = option(1, "Number of replica groups (each an ordinary job of this config's layout)")
    min_replica_size: int = option(1, "Fewest replica groups that may take a step together")
    timeout_seconds: float = option(
        60, "Collectives across groups, and fetching a peer's live state, fail after this long")
    quorum_timeout_seconds: float = option(
        300, "How long a step waits for the groups to agree who takes part (a relaunched group's start-up included)")
    semi_sync: SemiSync = section(SemiSync, "Synchronising the groups less often than every step (DiLoCo)")


@dataclass
class Eval:
    enable: bool = option(False, "Score lm-evaluation-harness tasks during training (pip install -e \".[eval]\")")
    tasks: list[str] = option(["pydocs_mc"], "lm-eval tasks; pydocs_mc is built in and offline")
    freq: int = option(1000, "Evaluate every this many steps")
    limit: int = option(0, "At most this many examples per task (0: all)")
    num_fewshot: int = option(-1, "Few-shot examples per prompt (-1: each task's default)")
    batch_size: int = option(8, "Sequences scored per forward")


@dataclass
class RL:
    prompts: str = option(
        "arithmetic", "Registered prompt task the prompts come from (torchtitan/rl/tasks.py; arithmetic is built in), "
        "when rl.prompts_path is unset")
    prompts_path: str | None = option(
        None, "JSONL file or Hugging Face dataset (folder or hub name) of rows with a prompt and what the rewards read; "
        "used instead of rl.prompts when set")
    prompt_column: str = option("prompt", "Column of rl.prompts_path rows holding the prompt text")
    chat: bool = option(True, "Render each prompt as a user message through the tokenizer's chat template")
    group_size: int = option(8, "Completions sampled per prompt (G); their rewards are compared within the group")
    prompts_per_step: int = option(8, "Prompts per optimizer step, over all data-parallel ranks")
    max_new_tokens: int = option(32, "Most tokens a completion may have")
    temperature: float = option(1.0, "Sampling temperature of the rollouts (> 0)")
    top_k: int = option(0, "Sample among the k most likely tokens (0: all)")
    top_p: float = option(1.0, "Sample from the nucleus of this probability (1: all)")
    rewards: list[str] = option(["exact_answer"], "Registered reward functions (torchtitan/rl/rewards.py); the "
                                                  "reward is their weighted sum")
    reward_weights: list[float] = option([], "Weight of each of rl.rewards (empty: 1 each)")
    reward_workers: int = option(2, "Worker processes scoring completions (0: in the trainer, no timeout)")
    reward_timeout_seconds: float = option(10.0, "A reward call that takes longer scores 0 and is counted")
    clip_low: float = option(0.2, "The ratio is clipped below at 1 - clip_low")
    clip_high: float = option(0.28, "The ratio is clipped above at 1 + clip_high (DAPO's clip-higher when larger)")
    kl_coeff: float = option(0.0, "Weight of the KL penalty to a frozen reference model (0: no reference is built)")
    loss_aggregation: Literal["sequence_mean", "token_mean", "token_sum"] = option(
        "sequence_mean", "sequence_mean: each completion's mean token loss, averaged (GRPO); token_mean: every token "
        "weighs the same (DAPO); token_sum: summed over the step, over completions x max_new_tokens (Dr. GRPO)")
    normalize_advantages: bool = option(True, "Divide each group's centred rewards by their std (GRPO; off: "
                                              "Dr. GRPO)")
    filter_equal_rewards: bool = option(True, "Leave out groups whose rewards are all equal (no learning signal)")
    epochs_per_batch: int = option(1, "Optimizer steps taken on each batch of rollouts")
    max_staleness: int = option(
        0, "0: generate each step's rollouts from the current weights; k > 0: a generator process works ahead with "
        "weights at most k versions old (asynchronous RL)")
    sampler: str = option("engine", "Registered sampler that generates the rollouts (torchtitan/rl/sampler.py); "
                                    "a module of experimental.custom_import can register an outside engine")
    cache_budget_bytes: int = option(0, "Key/value cache bytes the sampler may use per generation (0: no limit)")
    shuffle_rewards: bool = option(False, "Control experiment: shuffle each batch's rewards across its completions "
                                          "before the advantages (what is learned then is not from the rewards)")


@dataclass
class Debug:
    seed: int = option(0, "Seed for weight initialisation and everything random")
    deterministic: bool = option(False, "Use deterministic algorithms (slower)")


@dataclass
class Experimental:
    custom_import: str = option("", "Module imported at start, e.g. to register a custom model")


@dataclass
class JobConfig:
    job: Job = section(Job, "The run")
    profiling: Profiling = section(Profiling, "torch.profiler traces and memory snapshots")
    metrics: Metrics = section(Metrics, "Metrics logging")
    model: Model = section(Model, "Model family, size and tokenizer")
    optimizer: Optimizer = section(Optimizer, "Optimizer")
    lr_scheduler: LRScheduler = section(LRScheduler, "Learning-rate schedule")
    training: Training = section(Training, "Data, batch and precision")
    data: Data = section(Data, "Data mixtures: several sources by weight, in stages")
    parallelism: Parallelism = section(Parallelism, "Parallel layout")
    moe: MoE = section(MoE, "Mixture-of-Experts training: load balancing, router precision, expert kernels")
    checkpoint: Checkpoint = section(Checkpoint, "Checkpointing")
    activation_checkpoint: ActivationCheckpoint = section(ActivationCheckpoint, "Activation checkpointing")
    compile: Compile = section(Compile, "torch.compile")
    quantize: Quantize = section(Quantize, "Quantized training")
    lora: LoRA = section(LoRA, "Low-rank adapters (model.converters = [\"lora\"])")
    comm: Comm = section(Comm, "Collective communication")
    observability: Observability = section(Observability, "Per-rank step phases, stragglers, hangs and memory")
    fault_tolerance: FaultTolerance = section(FaultTolerance, "Replica groups that fail and rejoin mid-run (torchft)")
    validation: Validation = section(Validation, "Validation")
    eval: Eval = section(Eval, "Downstream tasks (lm-evaluation-harness) during training")
    rl: RL = section(RL, "Reinforcement learning from verifiable rewards (training.objective = \"grpo\")")
    debug: Debug = section(Debug, "Reproducibility")
    experimental: Experimental = section(Experimental, "Experimental extensions")
