"""The trainer's local SGD, bit for bit: SHA-256 of every replica's parameters after a fixed run
of 12 updates with each sync variant, recorded before the sync moves into the strategies'
extended (issue 29's item 4). A change that means to keep the trainer's behaviour keeps these
digests; one that changes a rule on purpose records new ones and says why. Recorded at the
commit that added this file (the in-step path gives the host path's bits with DiLoCo)."""

import hashlib

import pytest

from conftest import make_trainer
from test_sync import DILOCO, FEED_FORWARD, train_steps

IN_STEP = {"cluster_resolver": "local", "jit_compile": False}


def _digest(tmp_path, strategy: str, **options) -> str:
    trainer = make_trainer(tmp_path, FEED_FORWARD, strategy=strategy, distribute_options=options)
    copies = train_steps(trainer, 12, seed=0)
    digest = hashlib.sha256()
    for name in sorted(copies):
        for copy in copies[name]:
            digest.update(name.encode() + copy.tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("strategy,options,bits", [
    ("local_sgd", {"param_sync_step": 4}, "062754f2169281d8"),
    ("local_sgd", {"param_sync_step": 4, "outer_optimizer": DILOCO}, "069394800458a15e"),
    ("local_sgd", {"param_sync_step": 4, "sync_fragments": 2}, "7de075ebbd15ca20"),
    ("local_sgd", {"param_sync_step": 4, "outer_optimizer": DILOCO, "sync_delay": 1, "sync_mix": 0.5},
     "01135f12cb3654cb"),
    ("local_sgd", {"param_sync_step": 4, "sync_dtype": "int8"}, "74846b131e14550c"),
    ("local_sgd_tpu", {"param_sync_step": 4, "outer_optimizer": DILOCO, **IN_STEP}, "069394800458a15e"),
    ("local_sgd_tpu", {"param_sync_step": 4, "sync_fragments": 2, "sync_delay": 1, **IN_STEP}, "80e13b9714708384"),
], ids=["average", "diloco", "fragments", "diloco_delay", "int8", "in_step_diloco", "in_step_fragments_delay"])
def test_the_trainers_local_sgd_keeps_its_bits(tmp_path, strategy, options, bits):
    assert _digest(tmp_path, strategy, **options) == bits
