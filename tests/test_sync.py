"""Local SGD's variants (returnn_tpu.strategies.sync) on logical CPU devices, through the real trainer."""

import numpy
import pytest
import tensorflow as tf

from conftest import make_trainer, random_step_batches, replica_values
from returnn_tpu import checkpoints

FEED_FORWARD = {  # four parameters: four fragments of one parameter each
    "hidden": {"class": "linear", "activation": "tanh", "n_out": 16, "from": "data"},
    "output": {"class": "softmax", "loss": "ce", "from": "hidden"},
}
TRAIN_100 = {"class": "Task12AXDataset", "num_seqs": 100}
DILOCO = {"class": "nesterov", "learning_rate": 0.7, "momentum": 0.9}


def params(trainer):
    """{name: [copy of each replica]}."""
    return trainer.steps.parameter_copies()


def train_steps(trainer, steps, seed, learning_rate=0.1):
    rng = numpy.random.RandomState(seed)
    for _ in range(steps):
        trainer.train_step(random_step_batches(rng, trainer.steps.local_replicas), learning_rate)
    return params(trainer)


def assert_params_close(a, b, atol):
    assert a.keys() == b.keys()
    for name in a:
        for copy_a, copy_b in zip(a[name], b[name]):
            numpy.testing.assert_allclose(copy_a, copy_b, atol=atol, rtol=0, err_msg=name)


def max_difference(a, b):
    return max(float(numpy.abs(x - y).max()) for name in a for x, y in zip(a[name], b[name]))


def replicas_equal(copies):
    return all(numpy.array_equal(copies[0], other) for other in copies[1:])


@pytest.mark.parametrize("outer", [{"class": "nesterov", "learning_rate": 1.0, "momentum": 0.0},
                                   {"class": "slowmo", "learning_rate": 1.0, "momentum": 0.0}],
                         ids=["nesterov", "slowmo"])
def test_outer_optimizer_of_lr_1_without_momentum_is_plain_averaging(tmp_path, outer):
    tf.random.set_seed(1)
    plain = train_steps(make_trainer(tmp_path / "plain", FEED_FORWARD, distribute_options={"param_sync_step": 3}),
                        10, seed=3)
    tf.random.set_seed(1)
    with_outer = train_steps(
        make_trainer(tmp_path / "outer", FEED_FORWARD,
                     distribute_options={"param_sync_step": 3, "outer_optimizer": outer}), 10, seed=3)
    assert_params_close(with_outer, plain, atol=1e-6)


def test_outer_momentum_changes_the_result(tmp_path):
    """The comparison above can fail: with momentum the outer step is not an average."""
    tf.random.set_seed(1)
    plain = train_steps(make_trainer(tmp_path / "plain", FEED_FORWARD, distribute_options={"param_sync_step": 3}),
                        10, seed=3)
    tf.random.set_seed(1)
    diloco = train_steps(make_trainer(tmp_path / "outer", FEED_FORWARD,
                                      distribute_options={"param_sync_step": 3, "outer_optimizer": DILOCO}), 10, seed=3)
    assert max_difference(plain, diloco) > 1e-3


def _epochs(tmp_path, num_epochs, strategy="local_sgd", **options):
    trainer = make_trainer(
        tmp_path, FEED_FORWARD, strategy=strategy, num_epochs=num_epochs,
        train={"class": "Task12AXDataset", "num_seqs": 22}, batch_size=150, max_seqs=3,
        distribute_options=options,
    )
    trainer.train()
    return trainer


def test_resume_continues_with_the_outer_momentum(tmp_path):
    options = {"param_sync_step": 3, "outer_optimizer": DILOCO}
    uninterrupted = _epochs(tmp_path / "a", 2, **options)
    _epochs(tmp_path / "b", 1, **options)
    saved = checkpoints.load(str(tmp_path / "b" / "model.001"))
    assert numpy.abs(saved["hidden/W/local_sgd_momentum"]).max() > 1e-4  # there is momentum to restore
    resumed = _epochs(tmp_path / "b", 2, **options)
    assert resumed.checkpoints.start_epoch() == 3  # it did resume, at epoch 2
    assert_params_close(params(resumed), params(uninterrupted), atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"outer_optimizer": DILOCO, "sync_fragments": 2}],
                         ids=["plain", "diloco_two_fragments"])
def test_in_step_sync_equals_host_sync_over_epochs_of_odd_length(tmp_path, options):
    options = dict(options, param_sync_step=5)
    host = _epochs(tmp_path / "host", 2, **options)
    in_step = _epochs(tmp_path / "in_step", 2, strategy="local_sgd_tpu", cluster_resolver="local",
                      jit_compile=False, **options)
    steps = [m["steps"] for m in _metrics(tmp_path / "host")]
    assert all(s % 5 for s in steps), steps  # epochs end mid-cycle
    assert in_step.syncs.updates_in_replica and not host.syncs.updates_in_replica
    assert_params_close(params(in_step), params(host), atol=1e-5)
    assert [m["syncs"] for m in _metrics(tmp_path / "in_step")] == [m["syncs"] for m in _metrics(tmp_path / "host")]


def _metrics(path):
    import json

    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def test_bfloat16_syncs_stay_close_to_float32_syncs(tmp_path):
    results = {}
    for dtype in ("float32", "bfloat16"):
        tf.random.set_seed(1)
        trainer = make_trainer(tmp_path / dtype, FEED_FORWARD,
                               distribute_options={"param_sync_step": 3, "sync_dtype": dtype})
        results[dtype] = train_steps(trainer, 12, seed=3)
    difference = max_difference(results["float32"], results["bfloat16"])
    largest = max(float(numpy.abs(c[0]).max()) for c in results["float32"].values())
    # bfloat16 keeps 8 significant bits: each sync rounds the change since the last one by <= 2^-8
    # of it. After 4 syncs here: 0.0012 at a largest parameter of 0.70 (docs/local_sgd.md, "Compressed syncs").
    print(f"bfloat16 against float32 syncs: max difference {difference:.3g}, max |param| {largest:.3g}")
    assert 0 < difference <= 3e-3 * largest, (difference, largest)


def test_hierarchical_groups_average_alone_then_all_together():
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.strategies import make_strategy
    from returnn_tpu.strategies.sync import ParameterAveraging, mean_over_all_replicas, mean_within_groups

    strategy = make_strategy(DistributeOptions(strategy="local_sgd", num_replicas=4))
    with strategy.scope():
        w = tf.Variable(tf.zeros([3]))
    strategy.extended.update(w, lambda copy, value: copy.assign(value), args=(
        strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.fill([3], float(ctx.replica_id_in_sync_group))),))

    def sync(collective):
        tf.function(lambda: strategy.run(lambda: ParameterAveraging().sync_in_replica(
            strategy, {"w": w}, collective, learning_rate=0.1, outer_step=False)), autograph=False)()
        return [float(c[0]) for c in replica_values(strategy, w)]

    assert sync(mean_within_groups(2)) == [0.5, 0.5, 2.5, 2.5]
    assert sync(mean_over_all_replicas) == [1.5, 1.5, 1.5, 1.5]


@pytest.mark.parametrize("in_step", [False, True], ids=["host", "in_step"])
@pytest.mark.parametrize("outer_class", ["nesterov", "slowmo"])
def test_outer_steps_follow_their_papers_rules(outer_class, in_step):
    """Three syncs of two replicas' differing copies, against the rules in NumPy: DiLoCo's
    Nesterov momentum (``m = mu m + g; new = anchor - lr (g + mu m)``) and SlowMo's heavy ball
    scaled by the inner learning rate (``m = mu m + g / lr_in; new = anchor - lr lr_in m``),
    ``g = anchor - mean(copies)``."""
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.strategies import make_strategy
    from returnn_tpu.strategies.sync import DiLoCoAveraging, SlowMoAveraging, mean_over_all_replicas

    strategy = make_strategy(DistributeOptions(strategy="local_sgd_tpu", cluster_resolver="local", num_replicas=2)
                             if in_step else DistributeOptions(strategy="local_sgd", num_replicas=2))
    outer_lr, mu, inner_lr = 0.7, 0.9, 0.25
    averaging = (DiLoCoAveraging if outer_class == "nesterov" else SlowMoAveraging)(learning_rate=outer_lr, momentum=mu)
    with strategy.scope():
        w = tf.Variable(tf.zeros([3]))
    averaging.create_state(strategy, {"w": w})
    sync = tf.function(lambda: strategy.run(lambda: averaging.sync_in_replica(
        strategy, {"w": w}, mean_over_all_replicas, learning_rate=tf.constant(inner_lr))), autograph=False)
    rng = numpy.random.RandomState(0)
    anchor, momentum = numpy.zeros(3, numpy.float32), numpy.zeros(3, numpy.float32)
    for _ in range(3):
        copies = [anchor + rng.normal(size=3).astype(numpy.float32) for _ in range(2)]
        strategy.extended.update(w, lambda copy, value: copy.assign(value), args=(
            strategy.experimental_distribute_values_from_function(lambda ctx: copies[ctx.replica_id_in_sync_group]),))
        sync()
        g = anchor - numpy.mean(copies, axis=0)
        if outer_class == "nesterov":
            momentum = mu * momentum + g
            anchor = anchor - outer_lr * (g + mu * momentum)
        else:
            momentum = mu * momentum + g / inner_lr
            anchor = anchor - outer_lr * inner_lr * momentum
        for copy in replica_values(strategy, w):
            numpy.testing.assert_allclose(copy, anchor, atol=1e-6, rtol=0)
        numpy.testing.assert_allclose(replica_values(strategy, averaging.anchors["w"])[1], anchor, atol=1e-6, rtol=0)


def test_schedule_of_hierarchy_and_fragments():
    from returnn_tpu.strategies.sync import SyncDue, SyncSchedule

    hierarchy = SyncSchedule(6, local_step=2)
    assert [hierarchy.step() for _ in range(6)] == [None, SyncDue(local=True), None, SyncDue(local=True), None,
                                                   SyncDue(fragments=(0,))]
    streaming = SyncSchedule(8, fragments=4)
    due = [streaming.step() for _ in range(16)]
    assert [i for i, d in enumerate(due, 1) if d] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [d.fragments for d in due if d][:4] == [(0,), (1,), (2,), (3,)]


def test_schedule_warmup_counts_the_whole_training_then_starts_the_first_cycle():
    from returnn_tpu.strategies.sync import SyncDue, SyncSchedule

    schedule = SyncSchedule(2, warmup=3, fragments=2)
    due = [schedule.step() for _ in range(7)]
    assert due[:3] == [SyncDue(mean_gradient=True)] * 3
    assert due[3:] == [SyncDue(fragments=(0,)), SyncDue(fragments=(1,))] * 2
    resumed = SyncSchedule(2, warmup=3)
    resumed.start_at(2)  # a checkpoint after 2 updates: one synchronous update is left
    assert [resumed.step() for _ in range(3)] == [SyncDue(mean_gradient=True), None, SyncDue(fragments=(0,))]


def test_schedule_ramp_grows_the_intervals_from_one_update_to_param_sync_step():
    """``param_sync_step_ramp`` R: a cycle that starts u updates after the warm-up is
    min(N, 1 + u * N // R) updates long; a resumed run continues the ramp where it stood."""
    from returnn_tpu.strategies.sync import SyncDue, SyncSchedule

    def sync_updates(schedule, updates):
        return [u for u in range(1, updates + 1) if schedule.step() is not None]

    ramp = SyncSchedule(4, ramp=8)
    # cycles start after 0, 1, 2, 4, 7, 11 updates: lengths 1, 1, 2, 3, 4, 4
    assert sync_updates(ramp, 15) == [1, 2, 4, 7, 11, 15]
    after_warmup = SyncSchedule(4, ramp=8, warmup=2)
    assert sync_updates(after_warmup, 17) == [1, 2, 3, 4, 6, 9, 13, 17]  # 1 and 2: the synchronous updates
    fragments = SyncSchedule(4, ramp=8, fragments=2)
    assert [fragments.step() for _ in range(4)] == [SyncDue(fragments=(0, 1)), SyncDue(fragments=(0, 1)),
                                                   SyncDue(fragments=(0,)), SyncDue(fragments=(1,))]
    resumed = SyncSchedule(4, ramp=8)
    resumed.start_at(4)  # a checkpoint (always after a full sync) after 4 updates
    assert [u + 4 for u in sync_updates(resumed, 11)] == [7, 11, 15]


def test_local_syncs_in_the_trainer_leave_the_outer_state_alone(tmp_path):
    trainer = make_trainer(tmp_path, FEED_FORWARD, distribute_options={
        "param_sync_step": 6, "local_param_sync_step": 2, "outer_optimizer": DILOCO})
    train_steps(trainer, 1, seed=0)
    anchor = trainer.strategy.extended.averaging.anchors["hidden/W"].numpy()
    after_2 = train_steps(trainer, 1, seed=1)
    assert replicas_equal(after_2["hidden/W"])  # one worker: the local sync averages all its replicas
    numpy.testing.assert_array_equal(trainer.strategy.extended.averaging.anchors["hidden/W"].numpy(), anchor)
    assert not numpy.array_equal(after_2["hidden/W"][0], anchor)
    train_steps(trainer, 4, seed=2)  # step 6: the global sync moves the anchor
    assert not numpy.array_equal(trainer.strategy.extended.averaging.anchors["hidden/W"].numpy(), anchor)
    # One global sync: each replica hands its float32 change of every parameter; a local round sends nothing.
    copies = params(trainer)
    full_sync = sum(len(copy) * copy[0].size * 4 for copy in copies.values())
    assert trainer.syncs.sync_stats == {"updates": 6, "syncs": 1, "local_syncs": 2, "bytes": full_sync}


@pytest.mark.parametrize("strategy", ["local_sgd", "local_sgd_tpu"])
def test_each_fragment_is_synced_once_per_cycle_and_alone(tmp_path, strategy):
    extra = {"cluster_resolver": "local", "jit_compile": False} if strategy == "local_sgd_tpu" else {}
    trainer = make_trainer(tmp_path, FEED_FORWARD, strategy=strategy,
                           distribute_options={"param_sync_step": 8, "sync_fragments": 4, **extra})
    rng = numpy.random.RandomState(0)
    for step in range(1, 17):
        trainer.train_step(random_step_batches(rng, 2), 0.1)
        if step == 1:
            fragments = trainer.strategy.extended.engine.fragments
            assert sorted(len(f) for f in fragments) == [1, 1, 1, 1]
        values = params(trainer)
        synced = [i for i, names in enumerate(fragments) if all(replicas_equal(values[n]) for n in names)]
        assert synced == ([(step // 2 - 1) % 4] if step % 2 == 0 else []), (step, synced)


@pytest.mark.parametrize("policy", ["average", "reset", "keep"])
def test_optimizer_state_at_sync(tmp_path, policy):
    trainer = make_trainer(tmp_path, FEED_FORWARD, optimizer={"class": "adam"}, learning_rate=0.01,
                           distribute_options={"param_sync_step": 3, "optimizer_state_at_sync": policy})
    train_steps(trainer, 3, seed=0, learning_rate=0.01)
    moments = replica_values(trainer.strategy, trainer.optimizer.slots["hidden/W"]["Adam"])
    slot_step = int(trainer.optimizer.slot_step.numpy())
    if policy == "average":
        assert replicas_equal(moments) and numpy.abs(moments[0]).max() > 0 and slot_step == 3
    elif policy == "reset":
        assert numpy.abs(moments).max() == 0 and slot_step == 0
    else:
        assert not replicas_equal(moments) and slot_step == 3


@pytest.mark.parametrize("strategy,options,message", [
    ("mirrored", {"param_sync_step": 4}, "['param_sync_step'] is an option of local SGD"),
    ("local_sgd", {"param_sync_step": 4, "param_sync_time_diff": 10}, "either 'param_sync_step' or"),
    ("local_sgd", {"outer_optimizer": {"class": "adam"}}, "'class' one of 'nesterov', 'slowmo'"),
    ("local_sgd", {"outer_optimizer": {"class": "nesterov", "momentum": 1.5}}, "['momentum'] must be a number in [0, 1)"),
    ("local_sgd", {"outer_optimizer": {"class": "nesterov", "lr": 1}}, "unknown key 'lr'"),
    ("local_sgd", {"sync_dtype": "int2"}, "'sync_dtype'] must be one of 'float32', 'bfloat16', 'float16', 'int8', "
                                          "'int4', got 'int2'"),
    ("local_sgd", {"sync_dtype": "bfloat16", "sync_error_feedback": True}, "applies to sync_dtype 'int8' or 'int4'"),
    ("local_sgd", {"sync_dtype": "int8", "sync_error_feedback": 1}, "['sync_error_feedback'] must be True or False"),
    ("local_sgd", {"sync_delay": -1}, "['sync_delay'] must be an int >= 0 (updates), got -1"),
    ("local_sgd", {"param_sync_step": 16, "sync_fragments": 4, "sync_delay": 4},
     "['sync_delay'] must be less than param_sync_step / sync_fragments (4 updates between two syncs"),
    ("local_sgd", {"sync_delay": 1, "optimizer_state_at_sync": "average"}, "must be 'keep' with sync_delay > 0"),
    ("local_sgd", {"sync_mix": 0.5}, "['sync_mix'] mixes overlapped syncs into the copies; it needs 'sync_delay' >= 1"),
    ("local_sgd", {"sync_delay": 1, "sync_mix": 1.0}, "['sync_mix'] must be a number in [0, 1), got 1.0"),
    ("mirrored", {"sync_delay": 1}, "['sync_delay'] is an option of local SGD"),
    ("local_sgd", {"optimizer_state_at_sync": "zero"}, "must be one of 'keep', 'average', 'reset'"),
    ("local_sgd", {"param_sync_step": 4, "local_param_sync_step": 4}, "must be smaller than param_sync_step (4)"),
    ("local_sgd", {"param_sync_step": 4, "sync_fragments": 5}, "at most param_sync_step (4)"),
    ("local_sgd", {"param_sync_time_diff": 5, "sync_fragments": 2}, "counts steps"),
    ("local_sgd", {"sync_fragments": 2, "optimizer_state_at_sync": "reset"}, "cannot be used with sync_fragments"),
    ("local_sgd_tpu", {"local_param_sync_step": 2, "param_sync_step": 4}, "one TPU host is one worker"),
])
def test_bad_sync_options_are_one_line_errors(strategy, options, message):
    from returnn_tpu.errors import ConfigError
    from returnn_tpu.options import DistributeOptions

    with pytest.raises(ConfigError) as error:
        DistributeOptions.from_config_values(strategy, options)
    assert message in str(error.value) and "\n" not in str(error.value)


def _dataset_with_a_nan_sequence(num_seqs=24, nan_seq=5):
    rng = numpy.random.RandomState(0)
    seqs = []
    for i in range(num_seqs):
        length = int(rng.randint(3, 9))
        data = rng.randn(length, 9).astype("float32")
        if i == nan_seq:
            data[1, 2] = numpy.nan  # a corrupt feature frame
        seqs.append({"data": data, "classes": rng.randint(0, 2, (length,)).astype("int32")})
    return {"class": "StaticDataset", "data": seqs, "output_dim": {"data": [9, 2], "classes": [2, 1]}}


@pytest.mark.parametrize("strategy", ["local_sgd", "mirrored", "local_sgd_tpu"])
def test_nonfinite_update_stops_the_run_and_is_never_applied(tmp_path, strategy):
    from returnn_tpu.faults import NonFiniteUpdate

    extra = {"cluster_resolver": "local", "jit_compile": False} if strategy == "local_sgd_tpu" else {}
    trainer = make_trainer(tmp_path, FEED_FORWARD, strategy=strategy, train=_dataset_with_a_nan_sequence(),
                           batch_size=20, max_seqs=2, distribute_options=extra)
    with pytest.raises(NonFiniteUpdate, match=r"epoch 1: replica [01], step \d+: non-finite loss nan"):
        trainer.train()
    assert not (tmp_path / "model.001.index").exists()
    for copies in params(trainer).values():  # the update with the NaN was not applied anywhere
        assert all(numpy.isfinite(copy).all() for copy in copies)


def test_nonfinite_updates_skipped_on_request(tmp_path):
    import json

    trainer = make_trainer(tmp_path, FEED_FORWARD, num_epochs=2, train=_dataset_with_a_nan_sequence(),
                           batch_size=20, max_seqs=2,
                           distribute_options={"skip_nonfinite_steps": True, "param_sync_step": 2})
    trainer.train()
    metrics = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
               for line in open(tmp_path / "metrics.jsonl")]
    # The NaN sequence, once per epoch in each of the 2 replicas' own copies (random_seed_offset).
    assert [m["skipped_nonfinite_updates"] for m in metrics] == [2, 2]
    assert all(numpy.isfinite(m["train_score"]) for m in metrics)
    saved = checkpoints.load(str(tmp_path / "model.002"))
    assert all(numpy.isfinite(value).all() for value in saved.values())


def test_a_step_or_save_longer_than_mpiruns_grace_is_said_once_naming_the_mca_parameter():
    """Under ``mpirun`` (a grace from its stop signal to SIGKILL), the first step time or save
    time over it gets one line; shorter ones and later ones nothing; without mpirun, nothing."""
    import io
    import types

    from returnn_tpu.faults import StopRequest

    log = types.SimpleNamespace(v1=io.StringIO())
    under_mpirun = StopRequest(None, 2, log, kill_grace=1.0)
    under_mpirun.check_grace("saving the model", 0.4)
    assert log.v1.getvalue() == ""
    under_mpirun.check_grace("a step", 6.5)
    under_mpirun.check_grace("saving the model", 3.0)
    lines = log.v1.getvalue().splitlines()
    assert lines == ["returnn-tpu: warning: a step took 6.5 s, and mpirun kills the ranks 1 s after it forwards a stop "
                     "signal (Open MPI's odls_base_sigkill_timeout): after a SIGTERM during one, nothing of this epoch "
                     "may be written; give more, e.g. mpirun --mca odls_base_sigkill_timeout 60"]
    alone = StopRequest(None, 1, log)
    alone.check_grace("a step", 100.0)
    assert log.v1.getvalue().splitlines() == lines


def test_a_diverged_model_is_never_written(tmp_path):
    """A learning rate of 1e38 overflows the parameters themselves; the run stops, unsaved."""
    from returnn_tpu.faults import NonFiniteScore

    trainer = make_trainer(tmp_path, FEED_FORWARD, learning_rate=1e38, train=TRAIN_100)
    with pytest.raises(NonFiniteScore, match="replica"):
        trainer.train()
    assert not (tmp_path / "model.001.index").exists()


def test_dynamic_learning_rate_sees_returnns_global_train_step():
    """RETURNN's ``dynamic_learning_rate``: the function gets RETURNN's global_train_step, which counts
    batches (the update after 2 micro-batches of the first update is step 1); the interval form
    decays within each interval; settings RETURNN's updater refuses are one-line errors."""
    from returnn_tpu.errors import ConfigError
    from returnn_tpu.optimizers import StepLearningRate

    seen = []

    def warmup(*, network, global_train_step, learning_rate, **kwargs):
        seen.append(network)
        return learning_rate * tf.cast(global_train_step, tf.float32)

    rate = StepLearningRate(warmup, accum=2)
    assert [float(rate(tf.constant(0.5), step)) for step in (0, 1, 2)] == [0.5, 1.5, 2.5]
    assert seen == [None] * 3
    decay = StepLearningRate({"interval": 3, "decay": 0.5})
    assert [float(decay(tf.constant(1.0), step)) for step in range(4)] == [1.0, 0.5, 0.25, 1.0]
    assert float(StepLearningRate()(tf.constant(0.25), 7)) == 0.25
    for bad in (lambda *, global_train_step, learning_rate: learning_rate,  # no **kwargs
                lambda *, epoch, learning_rate, **kwargs: learning_rate, {"interval": 0, "decay": 0.5}, "fast"):
        with pytest.raises(ConfigError, match="^dynamic_learning_rate must be"):
            StepLearningRate(bad)


@pytest.mark.parametrize("outer,sync_step,warns", [
    (DILOCO, 16, True),  # the paper's settings, few inner steps: 7x the mean change
    (DILOCO, 500, False),  # the paper's regime
    (DILOCO, None, False),  # syncs by time: the number of inner steps is not known
    ({"class": "nesterov", "learning_rate": 0.7, "momentum": 0.5}, 16, False),
    ({"class": "slowmo", "learning_rate": 1.0, "momentum": 0.8}, 16, True),
    (None, 16, False),  # plain averaging
])
def test_outer_settings_known_to_overshoot_are_warned_about_at_start(outer, sync_step, warns):
    from returnn_tpu.options import DistributeOptions
    from returnn_tpu.strategies.sync import make_averaging

    averaging = make_averaging(DistributeOptions.from_config_values("local_sgd", {"outer_optimizer": outer}))
    warning = averaging.start_warning(sync_step)
    assert bool(warning) == warns
    if warns:
        assert f"param_sync_step {sync_step}" in warning and "learning_rate / (1 - momentum)" in warning


@pytest.mark.parametrize("param_sync_step,fragments,delay,local_step", [
    (1, 1, 0, None), (3, 1, 0, None), (8, 4, 0, None), (6, 4, 0, None), (3, 4, 0, None), (4, 2, 1, None),
    (8, 4, 1, None), (9, 3, 2, None), (12, 2, 5, None), (6, 1, 0, 2), (12, 3, 1, 3), (8, 2, 2, 3)])
def test_the_traced_clock_of_tf2_programs_answers_as_the_trainers_schedule(param_sync_step, fragments, delay,
                                                                           local_step):
    """The two clocks side by side: the trainer's ``SyncSchedule`` on the host and the traced one a
    TF2 program's strategy counts (``TracedSchedule``, in a ``tf.function``), over five cycles with
    a ``sync_now`` (a restart, after applying the sync in flight) in the middle of the second and
    the fourth cycle: after every update the same fragments are due, applied and left in flight,
    and the same worker-local rounds (``local_step``) happen."""
    from returnn_tpu.strategies.sync import SyncDue, SyncSchedule, TracedSchedule

    host = SyncSchedule(param_sync_step, fragments=fragments, delay=delay, local_step=local_step)
    traced = TracedSchedule(param_sync_step, fragments=fragments, delay=delay, local_step=local_step)
    since_restart = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def after_update():
        updates = since_restart.assign_add(1)
        return traced.row(updates), traced.local_round(updates)

    @tf.function
    def sync_now():
        in_flight = traced.row(since_restart.read_value())[2]
        since_restart.assign(0)
        return in_flight

    def named(mask):
        return tuple(int(i) for i in numpy.flatnonzero(mask.numpy()))

    restarts = {param_sync_step + param_sync_step // 2 + 1, 3 * param_sync_step + 2}
    for update in range(1, 5 * param_sync_step + 1):
        if update in restarts:
            assert named(sync_now()) == host.take_in_flight(), update
            host.synced()
        due = host.step() or SyncDue()
        masks, local = after_update()
        assert tuple(named(mask) for mask in masks) == (due.fragments, due.applied, host.in_flight), update
        assert bool(local) == due.local, update
