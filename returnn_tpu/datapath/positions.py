"""Where an epoch's batches stand, so that a resumed epoch continues there without making the
sequences of the steps it passes over (docs/faults.md, "Resuming without replay").

RETURNN's batch generator (``Dataset._generate_batches``) keeps no state across a batch's end
but the sequence it has reached: the next batch begins with the next sequence (or chunk, or
frame) that ``iterate_seqs`` gives (FACTS.md, "Where a batch stream can continue"). So a
stream of batches continues bit for bit from a :data:`Position`, the sequence of the epoch's
order where the next batch begins and how much of it the batches before took, if the dataset
makes any sequence of the epoch without the ones before it. :func:`why_not_continuable` says
whether it does; :class:`ContinuedDataset` is the dataset's epoch from a position on, for
RETURNN's own generator.

Nothing here imports TensorFlow (the data producer process uses it).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

Position = Tuple[int, Union[int, dict]]
"""``(seq_idx, frames)``: the next batch begins in sequence ``seq_idx`` of the epoch's order;
with a recurrent network, at its first chunk that starts at frame ``frames`` or later (0: the
whole sequence); without (frame-wise batches), at frame ``frames[key]`` of each data key
(``"*"``: of the keys not named)."""

StreamPoint = Tuple[int, Position]
"""Where a stream of RETURNN batches stands: the batches made so far, and the :data:`Position`
where the next begins."""


class StepPoints:
    """For each step made (and not yet forgotten), where the stream of each of its batches stands
    after it: a :data:`StreamPoint`, or why there is none (a string). Written by the thread that
    makes the steps, read by the one that trains them."""

    def __init__(self):
        self._by_step: Dict[int, list] = {}

    def record(self, step: int, points: list):
        self._by_step[step] = points

    def take(self, step: int) -> Optional[list]:
        """Step ``step``'s points, forgotten here (the producer sends them on)."""
        return self._by_step.pop(step, None)

    def after(self, steps_done: int) -> Optional[list]:
        """The points after the first ``steps_done`` steps of the epoch (None at its start or for
        a step not made here); forgets those of the steps before, which are not asked for again
        (the trainer asks at every sync, which only moves forward)."""
        for step in [s for s in list(self._by_step) if s < steps_done - 1]:
            self._by_step.pop(step, None)
        return self._by_step.get(steps_done - 1) if steps_done > 0 else None


def why_not_continuable(dataset, batching, recurrent: bool) -> Optional[str]:
    """None if batches of ``dataset`` (as ``batching`` makes them) can continue from a
    :data:`Position`; else why not (the epoch is then continued by making the batches it passes
    over, as before)."""
    from returnn.datasets.basic import Dataset

    from returnn_tpu.datapath.batching import BatchingOptions

    if type(batching) is not BatchingOptions:
        return "XLA's buckets hold sequences across batches"
    if batching.shuffle_batches:
        return "shuffle_batches shuffles batches across a window of them"
    if type(dataset).iterate_seqs is not Dataset.iterate_seqs or dataset.custom_chunking_func:
        return f"{type(dataset).__name__} has its own iterate_seqs or chunking function"
    if type(dataset)._generate_batches is not Dataset._generate_batches:  # noqa: SLF001
        return f"{type(dataset).__name__} has its own batch generator"
    if recurrent and dataset.chunking_variance:
        return "chunking_variance draws each chunk's size from a generator the sequences before advance"
    if dataset.shuffle_frames_of_nseqs:
        return "shuffle_frames_of_nseqs shuffles frames across groups of sequences"
    if dataset.weights:
        return "sequence weights (pruning) draw from a generator the sequences before advance"
    return _why_not_random_access(dataset)


def _why_not_random_access(dataset) -> Optional[str]:
    """None if ``dataset`` makes sequence ``s`` of an epoch, right after ``init_seq_order``, as
    it makes it after the sequences before (FACTS.md, "Datasets that load any sequence first")."""
    from returnn.datasets.audio import OggZipDataset
    from returnn.datasets.cached import CachedDataset
    from returnn.datasets.generating import GeneratingDataset, StaticDataset
    from returnn.datasets.meta import MetaDataset
    from returnn.datasets.util.vocabulary import CharacterTargets, Utf8ByteTargets, Vocabulary

    name = type(dataset).__name__
    if isinstance(dataset, CachedDataset) or type(dataset) is StaticDataset:  # HDFDataset: reads any
        return None  # sequence's range from its file; StaticDataset holds them all
    if isinstance(dataset, GeneratingDataset):  # seeds its generator per (epoch, sequence)
        if (type(dataset).get_corpus_seq is GeneratingDataset.get_corpus_seq
                and type(dataset)._load_seqs is GeneratingDataset._load_seqs):  # noqa: SLF001
            return None
        return f"{name} overrides how GeneratingDataset makes a sequence"
    if isinstance(dataset, OggZipDataset):
        extractor = dataset.feature_extractor
        if extractor is not None and ((extractor.random_permute_opts and extractor.random_permute_opts.truth_value)
                                      or extractor.pre_process is not None or callable(extractor.features)):
            return "its audio options draw from one generator for the whole epoch (random_permute, pre_process)"
        if dataset.targets is not None and type(dataset.targets) not in (Vocabulary, CharacterTargets,
                                                                         Utf8ByteTargets):
            return f"its targets ({type(dataset.targets).__name__}) may draw from a generator for the whole epoch"
        return None
    if type(dataset) is MetaDataset:  # loads each sub-dataset's same sequence
        for key, sub in dataset.datasets.items():
            reason = _why_not_random_access(sub)
            if reason:
                return f"its dataset {key!r}: {reason}"
        return None
    return f"RETURNN's {name} is not known to make a sequence without the ones before it"


def position_after(batch, first_seq: int, ctx_left, recurrent: bool) -> Position:
    """Where the batches after RETURNN's ``batch`` begin (its sequence indices count from
    ``first_seq`` of the epoch's order; ``ctx_left`` is the dataset's, which the generator took
    off each start frame)."""
    last = batch.seqs[-1]
    start = last.seq_start_frame + ctx_left
    if recurrent:  # the next chunk after the last one
        return first_seq + last.seq_idx, int(start.max_value()) + 1
    end = start + last.frame_length
    frames = {key: int(value) for key, value in end.dict.items()}
    if end.value is not None:
        frames["*"] = int(end.value)  # the frames of keys not named
    return first_seq + last.seq_idx, frames


class ContinuedDataset:
    """``dataset``'s current epoch from ``position`` on, its sequences numbered from 0 there, for
    RETURNN's own ``iterate_seqs`` and batch generator (run on this view, so that they never ask
    for a sequence before it) and ``batch_to_raw_dict``. Everything else is the dataset's."""

    def __init__(self, dataset, position: Position, recurrent: bool):
        self._dataset = dataset
        self.first_seq, self._frames = position
        self._recurrent = recurrent
        # No sequence before the position is read: datasets that load in increasing order (and make
        # a sequence's length by loading up to it) then begin there.
        dataset.load_seqs(self.first_seq, self.first_seq)

    def __getattr__(self, name: str):
        return getattr(self._dataset, name)

    def is_less_than_num_seqs(self, n: int) -> bool:
        return self._dataset.is_less_than_num_seqs(self.first_seq + n)

    def get_seq_length(self, seq_idx: int):
        return self._dataset.get_seq_length(self.first_seq + seq_idx)

    def load_seqs(self, start: int, end: int):
        self._dataset.load_seqs(self.first_seq + start, self.first_seq + end)

    def get_data(self, seq_idx: int, key: str):
        return self._dataset.get_data(self.first_seq + seq_idx, key)

    def get_tag(self, seq_idx: int) -> str:
        return self._dataset.get_tag(self.first_seq + seq_idx)

    def sample(self, seq_idx: int) -> bool:
        return self._dataset.sample(self.first_seq + seq_idx)

    def iterate_seqs(self, recurrent_net=True, used_data_keys=None):
        """RETURNN's ``iterate_seqs`` from the position: of its first sequence, only what the
        batches before did not take."""
        from returnn.datasets.basic import Dataset
        from returnn.util.basic import NumbersDict

        for seq_idx, t_start, t_end in Dataset.iterate_seqs(self, recurrent_net, used_data_keys):
            if seq_idx == 0 and self._frames:
                if self._recurrent:
                    if t_start.max_value() < self._frames:
                        continue
                else:
                    frames = dict(self._frames)
                    rest = frames.pop("*", None)
                    taken = NumbersDict(numbers_dict=frames, broadcast_value=rest)
                    t_start = NumbersDict.max([t_start, taken])
                    if t_start.max_value() >= t_end.max_value():
                        continue
            yield seq_idx, t_start, t_end

    def generate_batches(self, **kwargs):
        """RETURNN's batches of this view."""
        from returnn.datasets.basic import Dataset

        return Dataset.generate_batches(self, **kwargs)

    def _generate_batches(self, **kwargs):
        from returnn.datasets.basic import Dataset

        return Dataset._generate_batches(self, **kwargs)  # noqa: SLF001
