"""Every config option RETURNN's TF training code reads, and what returnn-tpu does with it.

RETURNN keeps no list of its options. This table holds every option that the installed RETURNN's
``__main__.py`` (``rnn.py``), ``engine/base.py``, ``tf/engine.py``, ``tf/updater.py`` and
``tf/network.py`` read, each in exactly one class, with one short reason:

- :data:`SUPPORTED`: returnn-tpu implements it with RETURNN's meaning, or runs RETURNN's own code
  for it;
- :data:`REFUSED`: it changes what is trained (or, ``dry_run``, what is written) and is not
  implemented: ``startup.check_supported`` stops with a one-line error when the config turns it on
  (each is off by default); the reason describes the option in that error;
- :data:`WITHOUT_EFFECT`: it does not change what is trained here (TF1 sessions, debugging,
  logging, profiling, the PyTorch backend, or tasks other than training, which are handed to plain
  RETURNN).

``tests/test_config_keys.py`` reads those files of the installed RETURNN and fails when one reads
an option that is in no class, so that an option a RETURNN upgrade adds is not ignored unseen.
"""

_BATCHING = "RETURNN's batching of the train data"
_EXTERN_DATA = "RETURNN's own extern-data code"
_GRADIENT = "applied to each replica's gradient in RETURNN's order"
_START_EPOCH = "RETURNN's own start-epoch logic (EngineBase.get_train_start_epoch)"

SUPPORTED = {
    "EnableAutoNumpySharedMemPickling": "applied by RETURNN's own init_config, which returnn-tpu runs",
    "accum_grad_multiple_step": "N batches per update, their gradients summed, as in RETURNN",
    "adam": "the old flag for optimizer adam",
    "batch_size": _BATCHING,
    "behavior_version": "applied by RETURNN's own init_config",
    "calculate_exp_loss": "the exp of each cost in the scores, as RETURNN's runner",
    "cleanup_old_models": "RETURNN's own policy, run on returnn-tpu's checkpoints",
    "default_input": _EXTERN_DATA,
    "dev": "evaluated after every epoch",
    "dynamic_learning_rate": "each update's learning rate from a config function or interval/decay, as RETURNN's updater",
    "eval": "evaluated after every epoch",
    "eval_datasets": "evaluated after every epoch",
    "extern_data": _EXTERN_DATA,
    "get_network": "a network per epoch, switched as RETURNN's engine does",
    "grad_norm_to_clip_to_zero": _GRADIENT,
    "gradient_clip": _GRADIENT,
    "gradient_clip_avg_norm": _GRADIENT,
    "gradient_clip_global_norm": _GRADIENT,
    "gradient_clip_norm": _GRADIENT,
    "gradient_nan_inf_filter": _GRADIENT,
    "gradient_noise": "RETURNN's own noise function, per replica",
    "learning_rate": "RETURNN's own learning-rate control",
    "load_epoch": _START_EPOCH,
    "max_pad_size": _BATCHING,
    "max_seq_length": _BATCHING + " (RETURNN also drops longer 'dev' sequences; returnn-tpu evaluates all)",
    "max_seqs": _BATCHING,
    "maximize_grad_norm": "a second derivative through the trace, as RETURNN's updater",
    "min_seq_length": _BATCHING,
    "model": "checkpoints in RETURNN's format and names",
    "momentum": "optimizer momentum's default, and the old flag",
    "nadam": "the old flag for optimizer nadam",
    "network": "the network dict, built by RETURNN's TFNetwork",
    "num_epochs": "the last epoch",
    "num_inputs": _EXTERN_DATA,
    "num_outputs": _EXTERN_DATA,
    "optimizer": "classes sgd, momentum, adam, nadam; another class stops with an error",
    "optimizer_epsilon": "the epsilon of adam and nadam, default 1e-16 as in RETURNN",
    "pretrain_learning_rate": "the learning rate of pretrain epochs",
    "random_seed": "RETURNN's per-epoch seeds of a new network",
    "reinit_network_each_epoch": "a new network every epoch, parameters carried over",
    "save_epoch1_initial_model": "model.000 before the first step",
    "save_interval": "checkpoints every N epochs",
    "shuffle_batches": _BATCHING,
    "sparse_input": _EXTERN_DATA + " (with num_inputs)",
    "start_batch": _START_EPOCH + ", which allows only 'auto'",
    "start_epoch": _START_EPOCH,
    "stop_on_nonfinite_train_score": "stop, or go on, after an epoch with a NaN/Inf train score",
    "target": _EXTERN_DATA,
    "task": "train and initialize_model run here; every other task is handed to plain RETURNN",
    "tf_log_dir": "where the TensorBoard summaries go",
    "tf_session_opts": "mapped to TF2 settings; parts without one are logged as ignored",
    "train": "the training data",
    "use_learning_rate_control_always": "learning-rate control also in pretrain epochs",
    "window": _EXTERN_DATA + " (num_inputs of an HDF file)",
}

_OLD_OPTIMIZER_FLAG = "an old optimizer flag; returnn-tpu has optimizer sgd, momentum, adam, nadam"
_OTHER_CHECKPOINT = "initial parameters from another model's checkpoint"

REFUSED = {
    "adadelta": _OLD_OPTIMIZER_FLAG,
    "adagrad": _OLD_OPTIMIZER_FLAG,
    "dataset_pipeline": "a TF dataset pipeline in place of RETURNN's batching",
    "decouple_constraints": "decoupled constraints (L2 as weight decay)",
    "distributed_tf": "RETURNN's distributed TF (use distribute_strategy instead)",
    "dry_run": "training without saving anything",
    "eval_use_train_flag": "evaluating the dev data with the train flag",
    "extra_updates": "extra updates of variables",
    "get_model": "a RETURNN-frontend model (use a network dict)",
    "global_norm_tag": "global norms per tag",
    "gradient_clip_global_norm_tag": "global norms per tag",
    "import_model_train_epoch1": _OTHER_CHECKPOINT,
    "inc_seq_length": "a max_seq_length that grows every epoch",
    "init_new_network_callback": "a config function called on each new network",
    "load": _OTHER_CHECKPOINT + "; resuming from this model's own checkpoints needs no option",
    "preload_from_files": "its entries with init_for_train: initial parameters from other checkpoints; "
                          "recognition entries are fine",
    "reset_updater_vars_mod_step": "resetting the optimizer's state every N steps",
    "rmsprop": _OLD_OPTIMIZER_FLAG,
    "search_train_network_layers": "training through search",
    "seq_drop": "dropping sequences from the train batches",
    "startup_callback": "a config function run at RETURNN's start-up",
    "update_batch_size": "update_batch_size",
    "use_dummy_datasets": "dummy datasets in place of the config's",
    "use_horovod": "Horovod (use distribute_strategy instead)",
    "use_last_best_model": "going back to the best epoch's model",
}

_DEBUG = "debugging aid of RETURNN's TF1 engine"
_LOGGING = "what RETURNN logs"
_PYTORCH = "PyTorch backend only (another backend is refused)"
_UNUSED = "read but not used by RETURNN's TF engine"


def _task(name: str) -> str:
    return f"task {name}, which is handed to plain RETURNN"


WITHOUT_EFFECT = {
    "PYTORCH_CUDA_ALLOC_CONF": _PYTORCH,
    "allow_random_model_init": "tasks other than training, whose model may be missing",
    "allow_skipping_seqs_in_forward": _task("forward"),
    "analyze_dataset": _task("analyze_data"),
    "cache_size": "how much of an HDFDataset RETURNN's main keeps in memory, not which data",
    "check_unsupported_device": _DEBUG,
    "combine_labels": _task("forward"),
    "ctc_prior_file": _UNUSED,
    "data_key": _task("analyze_data"),
    "debug_add_check_numerics_ops": _DEBUG,
    "debug_grad_summaries": _DEBUG,
    "debug_save_updater_vars": _DEBUG + " (returnn-tpu's checkpoints always hold the optimizer state)",
    "debug_shell_in_runner": _DEBUG,
    "debug_shell_in_runner_step": _DEBUG,
    "decouple_constraints_factor": "read only with decouple_constraints, which is refused",
    "deterministic_train": "TF1's order of summing a gradient's parts (and a warning): the same sum",
    "device": "a TF1 device; distribute_strategy places the replicas (logged as ignored)",
    "dummy_dataset_num_seqs": "read only with use_dummy_datasets, which is refused",
    "enforce_min_len1": "pads an all-empty batch's arrays to one frame; the lengths, so the loss, stay",
    "epoch": _task("eval, forward, compute_priors or analyze_data"),
    "eval_learning_rate": _task("eval") + " (train_in_eval)",
    "eval_output_file": _task("eval"),
    "eval_output_file_per_seq": _task("eval"),
    "exclude": _UNUSED,
    "forward_batch_size": _task("forward"),
    "forward_callback": _task("forward"),
    "forward_data": _task("forward"),
    "forward_output_layer": _task("forward"),
    "forward_override_hdf_output": _task("forward"),
    "forward_use_search": _task("forward"),
    "horovod_avg_grad": "read only with use_horovod, which is refused",
    "horovod_scale_lr": "read only with use_horovod, which is refused",
    "init_train_epoch_posthook": _UNUSED,
    "ipython": _DEBUG,
    "log_batch_size": _LOGGING,
    "log_grad_norm": _LOGGING,
    "loss_name": _task("eval"),
    "need_data": "tasks that need no data; training reads its data",
    "optimizer_use_locking": "TF1 locking of concurrent updates; here one update runs at a time",
    "output_file": _task("forward or compute_priors"),
    "output_per_seq_file_format": _task("eval"),
    "output_per_seq_format": _task("eval"),
    "patch_atfork": "a fork workaround of RETURNN's process start",
    "restart_after_num_net_reinit": "restarts RETURNN after N new TF graphs (a memory-leak workaround)",
    "search_data": _task("search"),
    "search_do_eval": _task("search"),
    "search_output_file": _task("search"),
    "search_output_file_format": _task("search"),
    "search_output_layer": _task("search"),
    "seq_drop_freq": "read only with seq_drop, which is refused",
    "share_batches": _UNUSED,
    "sil_label_idx": _task("analyze"),
    "statistics": _task("analyze"),
    "statistics_dtype": _task("analyze_data"),
    "statistics_save_prefix": _task("analyze_data"),
    "store_metadata_mod_step": "TF1 profiling",
    "store_tf_profile": "TF profiling",
    "tf_log_memory_usage": _LOGGING + " (GPU memory)",
    "tf_run_options": "TF1 session run options",
    "torch_distributed": _PYTORCH,
    "train_dummy_dataset_num_seqs": "read only with use_dummy_datasets, which is refused",
    "train_in_eval": _task("eval"),
    "use_lovely_tensors": _PYTORCH,
    "use_train_proc_manager": "restarts a crashed RETURNN process: how it runs, not what it trains",
    "watch_memory": _LOGGING + " (memory)",
    "web_server_port": _task("search_server"),
    "wrap_tf_session": "a wrapper of the TF1 session (e.g. a debugger); there is no session here",
}
