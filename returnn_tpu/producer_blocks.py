"""The POSIX shared memory blocks that carry a step's arrays from the producer to the trainer.

The producer writes each step's arrays into a new block (:func:`put_block`); only the block's
name and the arrays' layout travel through the queue, and the trainer copies the arrays out (one
``memcpy``) and frees the block (:func:`take_block`), or frees it untaken (:func:`free_block`).
Blocks are named after the producer's pid, so those of a producer that is gone can be removed
(:func:`remove_stale_blocks`). No TensorFlow (the producer process runs without it).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import sys
from typing import List

import numpy

from returnn_tpu.producer_protocol import ProducerError

BLOCK_PREFIX = "returnn_tpu_"  # shared memory blocks are named returnn_tpu_<producer pid>_<n>
SHM_RESERVE_BYTES = 16 * 1024 * 1024  # room left in /dev/shm for others when a block is made


def take_block(name: str, layout) -> List[dict]:
    """The batches of one step, copied out of shared memory block ``name``, which is freed."""
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name=name)
    try:
        batches = []
        for arrays in layout:
            batch = {}
            for key, (dtype, shape, offset, value) in arrays.items():
                if value is not None:  # not an array: sent as is
                    batch[key] = value
                else:
                    view = numpy.ndarray(shape, dtype=numpy.dtype(dtype), buffer=block.buf, offset=offset)
                    batch[key] = view.copy()
                    del view
            batches.append(batch)
        return batches
    finally:
        block.close()
        block.unlink()


def free_block(name: str):
    from multiprocessing import shared_memory

    try:
        block = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    block.close()
    block.unlink()


_blocks_made = itertools.count()


def remove_stale_blocks(log_file=None):
    """Removes the shared memory blocks of producers whose process is gone (a trainer killed by
    SIGKILL or the OOM killer cannot free what its producer made ahead), as stale checkpoint
    temporaries are removed. The line goes to ``log_file``, by default the ``sys.stderr`` of the
    moment (not of import time: a test harness or a redirected log may have replaced it)."""
    removed = 0
    for path in glob.glob(f"/dev/shm/{BLOCK_PREFIX}*_*"):
        pid = os.path.basename(path)[len(BLOCK_PREFIX):].split("_")[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.remove(path)
            removed += 1
        except OSError:
            pass  # another user's, or removed meanwhile
    if removed:
        print(f"returnn-tpu: removed {removed} shared memory blocks of data producers that are gone",
              file=log_file or sys.stderr)


def put_block(batches: List[dict]):
    """``(name, layout)`` of a new shared memory block holding the arrays of ``batches``."""
    from multiprocessing import resource_tracker, shared_memory

    layout, arrays, size = [], [], 0
    for batch in batches:
        entry = {}
        for key, value in batch.items():
            if isinstance(value, numpy.ndarray) and value.dtype != object:
                value = numpy.ascontiguousarray(value)
                entry[key] = (value.dtype.str, value.shape, size, None)
                arrays.append((size, value))
                size += -(-value.nbytes // 64) * 64  # aligned
            else:
                entry[key] = (None, None, None, value)
        layout.append(entry)
    # tmpfs gives a block its pages only when they are written, and a full one answers with SIGBUS:
    # check the room first.
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    try:
        if free is not None and free < size + SHM_RESERVE_BYTES:
            raise OSError(28, "not enough room left")
        block = shared_memory.SharedMemory(name=f"{BLOCK_PREFIX}{os.getpid()}_{next(_blocks_made)}", create=True,
                                           size=max(size, 1))
    except OSError as exc:
        raise ProducerError(f"cannot make a shared memory block of {size / 1e6:.1f} MB for a step's batches in "
                            f"/dev/shm ({(free or 0) / 1e6:.1f} MB free there): {exc.strerror or exc}; make /dev/shm "
                            "larger (docker: --shm-size), or set distribute_options['data_producer'] = 'thread'") from None
    # The trainer frees the block; this process's resource tracker must not free it again.
    resource_tracker.unregister(block._name, "shared_memory")  # noqa: SLF001 (CPython's own name for it)
    for offset, value in arrays:
        numpy.ndarray(value.shape, dtype=value.dtype, buffer=block.buf, offset=offset)[...] = value
    name = block.name
    block.close()
    return name, layout
