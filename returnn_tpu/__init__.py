"""returnn_tpu: RETURNN's TensorFlow configs trained on many devices through ``tf.distribute``."""

import time

STARTED = time.perf_counter()  # when returnn-tpu started (its first import): metrics' startup_seconds
