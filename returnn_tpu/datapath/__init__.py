"""The data path: from RETURNN's datasets to each replica's batches of an epoch.

:mod:`.epochs` (what an epoch is for this worker, where the workers agree it ends) over
:mod:`.data` (an epoch's per-replica batches, streamed), :mod:`.batching` (RETURNN's batching, or
XLA's buckets), :mod:`.datasets` (RETURNN datasets as ``rnn.py`` makes them) and :mod:`.positions`
(where a stream of batches stands); the producer process that makes the batches beside the
trainer: :mod:`.producer` (the trainer's side), :mod:`.producer_process`, :mod:`.producer_serving`,
:mod:`.producer_blocks`, :mod:`.producer_protocol`. Only :mod:`.epochs` imports TensorFlow: the
producer process runs without it (``tests/test_imports.py``).
"""
