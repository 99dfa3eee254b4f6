"""Where an overlapped sync's all-reduce runs while the next steps compute (host path)."""

from __future__ import annotations

from tensorflow.python.eager import context, executor


class BackgroundCalls:
    """Calls of ``tf.function`` s that return at once and run on an executor thread of their own.

    A collective takes its instance key when its function is called, in the calling thread, and
    workers pair collectives by key; a call made here draws its keys in this thread's order, the
    same on every worker, while the work (an all-reduce, for minutes on a slow network) runs
    beside whatever this thread calls next (FACTS.md, "Overlapped syncs").
    """

    def __init__(self):
        self._executor = executor.new_executor(enable_async=True)

    def call(self, function, *args):
        """Starts ``function(*args)``; its results are not returned (it works on variables)."""
        with context.executor_scope(self._executor):
            function(*args)

    def wait(self):
        """Waits until every call has run; raises the first error one of them raised."""
        self._executor.wait()
