"""Every DeepSpeed config key :mod:`lightning_zero.deepspeed_config` knows: its kind and what it becomes.

The migration page of the documentation (``docs/deepspeed-config.md``) lists this table; a test
checks that it names every key.
"""

from __future__ import annotations

from typing import Any

from lightning_zero.deepspeed_optim import OPTIMIZER_KEYS, SCHEDULER_KEYS, Key

SAME_ANY = object()  # a tune key whose every value is what this package does


def _m(becomes: str) -> Key:
    return Key("map", becomes)


def _t(becomes: str, same: Any = None) -> Key:
    return Key("tune", becomes, same)


def _r(becomes: str, same: Any = None) -> Key:
    return Key("refuse", becomes, same)


Z = "zero_optimization."
OO, OP = Z + "offload_optimizer.", Z + "offload_param."
_MONITOR = "logging only: use a Lightning logger or profiler"

#: Every DeepSpeed key this module knows, by dotted path, with its kind and what it becomes.
KEYS: dict[str, Key] = {
    # batch sizes: the Trainer and the DataLoader own them; the config's values are checked against them
    "train_micro_batch_size_per_gpu": _m('checked against the train DataLoader\'s batch_size ("auto": not checked)'),
    "gradient_accumulation_steps": _m('checked against Trainer(accumulate_grad_batches) ("auto": not checked)'),
    "train_batch_size": _m('checked: micro batch x accumulation x data-parallel ranks ("auto": not checked)'),
    "gradient_clipping": _m("Trainer(gradient_clip_val=..., norm); set from the config when the Trainer has none"),
    "zero_allow_untested_optimizer": _m("allow_untested_optimizer"),
    "communication_data_type": _m('reduce_dtype ("fp32", "bf16", "fp16")'),
    "data_types.grad_accum_dtype": _m("reduce_dtype (gradients are accumulated in the reduce dtype)"),
    "checkpoint.use_node_local_storage": _m("node_local_storage"),
    "checkpoint.tag_validation": _t("checkpoints are validated by their manifest (always)", SAME_ANY),
    "checkpoint.load_universal": _t("sharded checkpoints load at any world size and stage (always)", SAME_ANY),
    "checkpoint.parallel_write": _t("every rank writes its own shards (always)", SAME_ANY),
    # ZeRO
    Z + "stage": _m('stage (0 is refused: use strategy="ddp")'),
    Z + "overlap_comm": _m("overlap_comm"),
    Z + "reduce_bucket_size": _m('reduce_bucket_size ("auto": "auto")'),
    Z + "allgather_bucket_size": _m("allgather_bucket_size"),
    Z + "stage3_prefetch_bucket_size": _m('prefetch_bucket_size ("auto": "auto")'),
    Z + "stage3_param_persistence_threshold": _m('param_persistence_threshold ("auto": the default, 100000)'),
    Z + "stage3_max_live_parameters": _m('max_live_parameters ("auto": the default, 1e9)'),
    Z + "cpu_offload": _m("offload_optimizer=True (DeepSpeed's older spelling)"),
    Z + "cpu_offload_params": _m("offload_parameters=True (DeepSpeed's older spelling)"),
    Z + "cpu_offload_use_pin_memory": _m("pin_memory (DeepSpeed's older spelling)"),
    Z + "contiguous_gradients": _t("gradients always go into contiguous buckets", True),
    Z + "reduce_scatter": _t("false (all-reduce instead) sums the same gradients; stages 2/3 reduce-scatter", True),
    Z + "allgather_partitions": _t("updated slices are always all-gathered", True),
    Z + "sub_group_size": _t("the host step walks buckets of reduce_bucket_size; no separate sub-group size"),
    Z + "stage3_max_reuse_distance": _t("parameters are freed after use unless below param_persistence_threshold"),
    Z + "stage3_gather_16bit_weights_on_model_save": _t(
        'saving is sharded unless state_dict_type="full"; `lightning-zero consolidate` makes one file', False
    ),
    Z + "stage3_gather_fp16_weights_on_model_save": _t("as stage3_gather_16bit_weights_on_model_save", False),
    Z + "round_robin_gradients": _t("gradient partitioning order only"),
    Z + "elastic_checkpoint": _t("sharded checkpoints reshard to any world size (always)", SAME_ANY),
    Z + "load_from_fp32_weights": _t("fp32 masters are always restored from the checkpoint", True),
    Z + "ignore_unused_parameters": _t("unused parameters are always allowed", True),
    Z + "legacy_stage1": _t("DeepSpeed's older stage-1 code path", False),
    Z + "memory_efficient_linear": _t("DeepSpeed's own Linear wrapper; no effect on results", SAME_ANY),
    Z + "stage3_module_granularity_threshold": _t("stage 3 gathers module by module"),
    Z + "module_granularity_threshold": _t("stage 3 gathers module by module"),
    Z + "use_all_reduce_for_fetch_params": _t("parameters are gathered with all-gather", False),
    Z + "log_trace_cache_warnings": _t(_MONITOR, SAME_ANY),
    Z + "use_multi_rank_bucket_allreduce": _t("bucket reduction scheduling only", SAME_ANY),
    Z + "mics_shard_size": _r("MiCS (sharding over a sub-group) is not implemented; remove it", -1),
    Z + "mics_hierarchical_params_gather": _r("MiCS is not implemented; remove it", False),
    Z + "zero_hpz_partition_size": _r("ZeRO++ hierarchical partitioning is not implemented; remove it", 1),
    Z + "zero_quantized_weights": _r("ZeRO++ quantized weights change results and are not implemented", False),
    Z + "zero_quantized_nontrainable_weights": _r("ZeRO++ quantized weights are not implemented", False),
    Z + "zero_quantized_gradients": _r("ZeRO++ quantized gradients change results and are not implemented", False),
    Z + "zeropp_loco_param": _r("ZeRO++ LoCo is not implemented; remove it"),
    OO + "device": _m('offload_optimizer: "cpu" -> "cpu", "nvme" -> "nvme", "none" -> False'),
    OO + "nvme_path": _m("nvme_path"),
    OO + "pin_memory": _m("pin_memory"),
    OO + "buffer_count": _m('nvme_config["buffer_count"] (with device "nvme")'),
    OO + "pipeline_read": _t("NVMe reads always run ahead of the step (buffer_count)", SAME_ANY),
    OO + "pipeline_write": _t("NVMe writes always run behind the step (buffer_count)", SAME_ANY),
    OO + "pipeline": _t("offload_pipeline is on by default", SAME_ANY),
    OO + "fast_init": _t("NVMe swap files are written at setup", SAME_ANY),
    OO + "ratio": _t("a fraction of the optimizer offloaded; everything named is offloaded here", 1.0),
    OP + "device": _m('offload_parameters: "cpu" -> "cpu", "nvme" -> "nvme", "none" -> False'),
    OP + "nvme_path": _m("nvme_path (one directory for both tiers)"),
    OP + "pin_memory": _m("pin_memory"),
    OP + "buffer_count": _m('nvme_config["param_buffer_count"] (with device "nvme")'),
    OP + "buffer_size": _t("parameter buffers are sized per shard"),
    OP + "max_in_cpu": _t("parameter shards on NVMe are staged through buffer_count host buffers"),
    # NVMe I/O
    "aio.block_size": _m('nvme_config["block_size"]'),
    "aio.queue_depth": _m('nvme_config["queue_depth"]'),
    "aio.intra_op_parallelism": _m('nvme_config["threads"]'),
    "aio.thread_count": _m('nvme_config["threads"] (DeepSpeed\'s older spelling)'),
    "aio.single_submit": _t("request submission of DeepSpeed's libaio engine", SAME_ANY),
    "aio.overlap_events": _t("event overlap of DeepSpeed's libaio engine", SAME_ANY),
    "aio.use_gds": _t("GPUDirect Storage: data goes through host memory here", False),
    # precision
    "fp16.enabled": _m('Trainer(precision="16-mixed") is required ("auto": the Trainer\'s precision)'),
    "fp16.loss_scale": _m("0: dynamic loss scaling (loss_scale=LossScaleConfig); a fixed scale is refused"),
    "fp16.initial_scale_power": _m("LossScaleConfig(initial_scale=2**power)"),
    "fp16.loss_scale_window": _m("LossScaleConfig(growth_interval=window)"),
    "fp16.min_loss_scale": _m("LossScaleConfig(min_scale=...)"),
    "fp16.hysteresis": _t("overflows tolerated before the scale drops; here every overflow halves it", 1),
    "fp16.consecutive_hysteresis": _t("see hysteresis", False),
    "fp16.auto_cast": _t('under "16-mixed" forward runs in torch.autocast(float16) anyway', SAME_ANY),
    "fp16.fp16_master_weights_and_grads": _r("fp16 masters are not implemented: masters are fp32", False),
    "bf16.enabled": _m('Trainer(precision="bf16-mixed") is required ("auto": the Trainer\'s precision)'),
    "bf16.immediate_grad_update": _t("gradients are reduced into buckets as they are produced", SAME_ANY),
    "bf16.check_grad_overflow": _t("non-finite gradients are handled by on_nonfinite", SAME_ANY),
    "bf16.bf16_master_weights_and_grads": _r('use Trainer(precision="bf16-true") without the bf16 section', False),
    "bf16.bf16_optimizer_states": _r('use Trainer(precision="bf16-true") without the bf16 section', False),
    "torch_autocast.enabled": _r(
        'autocast over fp32 parameters: use lightning\'s DDP with precision="bf16-mixed"', False
    ),
    "torch_autocast.dtype": _r("see torch_autocast.enabled"),
    "torch_autocast.lower_precision_safe_modules": _r("see torch_autocast.enabled"),
    "amp.enabled": _r('apex AMP: use Trainer(precision="16-mixed") with the fp16 section', False),
    "amp.opt_level": _r("see amp.enabled"),
    "prescale_gradients": _t("gradients are divided by the world size once, after the sum", False),
    "gradient_predivide_factor": _r("gradients are averaged after the sum; remove it (1.0)", 1.0),
    "sparse_gradients": _r("sparse embedding gradients are not implemented; remove it", False),
    # activation checkpointing: DeepSpeed's apply to code that calls deepspeed.checkpointing
    "activation_checkpointing.cpu_checkpointing": _m(
        "activation_checkpointing_offload (needs activation_checkpointing=<policy> given to the strategy)"
    ),
    "activation_checkpointing.partition_activations": _t("checkpointed inputs are not split over model-parallel ranks"),
    "activation_checkpointing.contiguous_memory_optimization": _t("memory layout of checkpoints only"),
    "activation_checkpointing.number_checkpoints": _t("with contiguous_memory_optimization only"),
    "activation_checkpointing.synchronize_checkpoint_boundary": _t("a debugging synchronization", False),
    "activation_checkpointing.profile": _t(_MONITOR, False),
    # tensor parallelism
    "tensor_parallel.autotp_size": _m("tensor_parallel_size (the plan: tensor_parallel_plan or the module's)"),
    "tensor_parallel.tp_size": _m("tensor_parallel_size"),
    "tensor_parallel.tp.tp_size": _m("tensor_parallel_size"),
    "tensor_parallel.tp_grain_size": _t("AutoTP's padding granularity", SAME_ANY),
    "tensor_parallel.tp_overlap_comm": _t("AutoTP communication overlap", SAME_ANY),
    "tensor_parallel.partition_config": _r("AutoTP partition rules: give tensor_parallel_plan instead"),
    "tensor_parallel.injection_policy_tuple": _r("AutoTP injection policies: give tensor_parallel_plan instead"),
    # DeepSpeed's own logging, profiling and tuning
    "steps_per_print": _t(_MONITOR, SAME_ANY),
    "wall_clock_breakdown": _t(_MONITOR, False),
    "dump_state": _t(_MONITOR, False),
    "memory_breakdown": _t("use lightning_zero's memory report (`lightning-zero report`)", False),
    "prescale_gradients_dtype": _t("see prescale_gradients"),
    "dataloader_drop_last": _t("DeepSpeed's own DataLoader only: the LightningDataModule's DataLoader is used"),
    "zero_force_ds_cpu_optimizer": _t("the CPU step always uses lightning_zero.ops kernels", SAME_ANY),
    "seq_parallel_communication_data_type": _t("DeepSpeed-Ulysses only", SAME_ANY),
    "graph_harvesting": _t("CUDA graph capture of DeepSpeed's kernels", False),
    "timers": _t(_MONITOR),
    "comms_logger": _t(_MONITOR),
    "flops_profiler": _t(_MONITOR),
    "tensorboard": _t(_MONITOR),
    "wandb": _t(_MONITOR),
    "csv_monitor": _t(_MONITOR),
    "comet": _t(_MONITOR),
    "monitor_config": _t(_MONITOR),
    "autotuning": _t("DeepSpeed's autotuner; tune with `lightning-zero report`"),
    "compile": _t("DeepSpeed's compile wrapper: use torch.compile on the module (supported)"),
    "nebula": _t("Azure Nebula checkpoint service: use the checkpoint object stores"),
    "elasticity": _r("elastic batch sizes are not implemented: fix the world size"),
    "sparse_attention": _r("DeepSpeed's sparse attention kernels: use your model's own attention"),
    "curriculum_learning": _r("data scheduling belongs in the DataModule"),
    "data_efficiency": _r("data sampling and random-LTD belong in the DataModule and the model"),
    "compression_training": _r("DeepSpeed Compression: run it before or after training with DeepSpeed"),
    "quantize_training": _r("MoQ quantization is not implemented"),
    "weight_quantization": _r("weight quantization is not implemented"),
    "progressive_layer_drop": _r("progressive layer drop changes the model: implement it in the LightningModule"),
    "eigenvalue": _r("eigenvalue-based quantization scheduling is not implemented"),
    "hybrid_engine": _r("the RLHF hybrid engine is not implemented"),
    "sequence_parallel_size": _r("DeepSpeed-Ulysses is not implemented: see sequence_parallel (Megatron style)", 1),
    "pipeline": _r("DeepSpeed's PipelineModule: give pipeline_parallel_size and configure_pipeline() instead"),
    "zenflow": _r("ZenFlow is not implemented"),
    "moe": _r("expert parallelism is not implemented"),
    "expert_parallel": _r("expert parallelism is not implemented"),
    **OPTIMIZER_KEYS,
    **SCHEDULER_KEYS,
}

#: Sections whose keys are known one by one (anything else under them is "not a known key").
SECTIONS = {
    "zero_optimization",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "aio",
    "fp16",
    "bf16",
    "torch_autocast",
    "amp",
    "activation_checkpointing",
    "tensor_parallel",
    "tensor_parallel.tp",
    "checkpoint",
    "data_types",
}
