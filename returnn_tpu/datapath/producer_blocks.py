"""The POSIX shared memory blocks that carry a step's arrays from the producer to the trainer.

The producer writes each step's arrays into one of a ring of blocks (:class:`BlockWriter`); only
the block's name and the arrays' layout travel through the queue, and the trainer copies the
arrays out (one ``memcpy``) and counts the step as released (:class:`BlockReader`), or releases
it untaken. A block is reused once the trainer has released the step it held: a new block per
step cost the producer about 1 ms per step of 1.6 MB (tmpfs gives a block its pages, zeroed, as
they are first written), as much as a 6-10 ms step's data costs to read (FACTS.md, "Fresh shared
memory per step"). Blocks are named after the producer's pid, so those of a producer that is
gone can be removed (:func:`remove_stale_blocks`). No TensorFlow (the producer process runs
without it).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import sys
import time
from typing import Dict, List

import numpy

from returnn_tpu.datapath.producer_protocol import ProducerError

BLOCK_PREFIX = "returnn_tpu_"  # shared memory blocks are named returnn_tpu_<producer pid>_<n>
SHM_RESERVE_BYTES = 16 * 1024 * 1024  # room left in /dev/shm for others when a block is made
GROWTH = 1.25  # a block too small for a step is replaced by one this much larger than the step needs
RELEASE_POLL_SECONDS = 0.001  # how often a producer ahead of the ring looks whether a block is free


class BlockReader:
    """The trainer's side: copies a step's arrays out of the block named in its message and counts
    the step as released in ``released`` (a ``multiprocessing`` ``RawValue`` shared with the
    producer), keeping the blocks of the ring mapped, as the producer reuses them."""

    def __init__(self, released, ring: int):
        self.released = released
        self.ring = ring
        self._open: Dict[str, object] = {}  # name -> SharedMemory, oldest first

    def _block(self, name: str):
        from multiprocessing import resource_tracker, shared_memory

        block = self._open.pop(name, None)
        if block is None:
            block = shared_memory.SharedMemory(name=name)
            # Python < 3.13 has this process's resource tracker unlink, and warn of, every block it
            # opened when it exits; the producer's blocks are removed by DataProducer.close.
            resource_tracker.unregister(block._name, "shared_memory")  # noqa: SLF001 (CPython's own name for it)
        self._open[name] = block  # now the newest
        while len(self._open) > self.ring:  # replaced by a larger one: the producer has unlinked it
            self._open.pop(next(iter(self._open))).close()
        return block

    def take(self, name: str, layout) -> List[dict]:
        """The batches of one step, copied out of block ``name``; the step is released."""
        block = self._block(name)
        batches = []
        for arrays in layout:
            batch = {}
            for key, (dtype, shape, offset, value) in arrays.items():
                if value is not None:  # not an array: sent as is
                    batch[key] = value
                else:
                    batch[key] = numpy.ndarray(shape, dtype=numpy.dtype(dtype), buffer=block.buf, offset=offset).copy()
            batches.append(batch)
        self.release()
        return batches

    def release(self):
        """The next step's block is free for the producer (taken, or not to be taken)."""
        self.released.value += 1

    def close(self):
        for block in self._open.values():
            block.close()
        self._open.clear()


class BlockWriter:
    """The producer's side: writes each step's arrays into block ``n % ring`` of the ``n``-th step
    it hands over, once the trainer has released step ``n - ring`` (``released``: see
    :class:`BlockReader`). The producer's queue holds at most ``prefetch`` steps, so with a ring
    of ``prefetch + 2`` the block is free already and the wait is not taken; it guards the reuse
    all the same. A block too small for a step is replaced (unlinked: the trainer has released it);
    the others stay until the trainer, which may still have steps to read after the producer has
    ended, removes them (:meth:`returnn_tpu.datapath.producer.DataProducer.close`)."""

    def __init__(self, released, ring: int):
        self.released = released
        self.ring = ring
        self._blocks: List[object] = []  # slot -> SharedMemory
        self._handed = 0  # steps handed over

    def put(self, batches: List[dict]):
        """``(name, layout)`` of the block now holding the arrays of ``batches``."""
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
        while self.released.value < self._handed - self.ring + 1:  # the trainer still reads this slot
            time.sleep(RELEASE_POLL_SECONDS)
        block = self._slot(self._handed % self.ring, size)
        for offset, value in arrays:
            numpy.ndarray(value.shape, dtype=value.dtype, buffer=block.buf, offset=offset)[...] = value
        self._handed += 1
        return block.name, layout

    def _slot(self, slot: int, size: int):
        """The block of ``slot``, replaced by a larger one if it is smaller than ``size`` bytes."""
        if slot == len(self._blocks):
            self._blocks.append(_new_block(int(size * GROWTH)))
        elif self._blocks[slot].size < size:
            _unlink(self._blocks[slot])
            self._blocks[slot] = _new_block(int(size * GROWTH))
        return self._blocks[slot]


def _unlink(block):
    """Unlinks a block made by :func:`_new_block`. ``SharedMemory.unlink`` also tells the resource
    tracker (which the trainer and the producer share) to forget the name, so it is told of it first."""
    from multiprocessing import resource_tracker

    block.close()
    resource_tracker.register(block._name, "shared_memory")  # noqa: SLF001 (CPython's own name for it)
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


def _new_block(size: int):
    """A new shared memory block of ``size`` bytes, named after this process."""
    from multiprocessing import resource_tracker, shared_memory

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
    # This process unlinks its blocks itself (or the trainer does, after a kill); its resource
    # tracker must not do it again, nor warn of them as leaked.
    resource_tracker.unregister(block._name, "shared_memory")  # noqa: SLF001 (CPython's own name for it)
    return block
