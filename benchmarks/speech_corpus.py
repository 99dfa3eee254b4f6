"""A speech corpus with real audio, in the layout RETURNN's ``OggZipDataset`` reads as it is.

The other benchmarks train on text (benchmarks/corpus.py's Brown corpus) or on RETURNN's toy
tasks; a published ASR setup reads Ogg audio through ``OggZipDataset``, extracts features on the
fly (``ExtractAudioFeatures``: MFCC or log-mel, librosa) and trains a CTC or attention model on
characters. No speech corpus can be downloaded here, so this script synthesizes one: sentences
of the Brown corpus (as benchmarks/corpus.py prepared it) spoken by ``espeak-ng`` with a voice,
speed and pitch drawn per utterance by a seeded RNG. Synthetic speech is far easier than real
speech, but the data path (Ogg Vorbis decoding, feature extraction, sorting by duration,
frame-based batching, CTC over characters) is exactly the published one.

Sentences: lower-cased, hyphens become spaces, quotes and punctuation tokens are dropped,
apostrophes kept only inside a word; sentences with digits, abbreviations (a token with an inner
``.``) or other characters outside a-z, space and apostrophe are left out, and so are those of
fewer than 3 or more than 20 words. Of the rest, a seeded shuffle picks the utterances (train
from ``train.txt``, dev from ``dev.txt``). Speech: ``espeak-ng --stdout`` (WAV, 22050 Hz) with
one of several English voices and variants, ``-s`` 130-200 words per minute, ``-p`` 30-70,
resampled to 16 kHz (scipy's polyphase filter) and written as Ogg Vorbis (soundfile), by a
pool of 2 processes. It writes into ``--out`` (default ``~/.cache/returnn_tpu/speech``):

* ``train.zip``, ``dev.zip``: each holds ``NAME.txt``, a Python-literal list of dicts with
  ``text``, ``duration`` (seconds), ``file`` (inside the folder ``NAME/``) and ``seq_name``, and
  ``NAME/*.ogg`` (16 kHz mono): RETURNN's ``{"class": "OggZipDataset", "path": ".../train.zip"}``;
* ``chars.vocab``: the 28 characters (space, apostrophe, a-z) as a Python dict character -> index,
  RETURNN's ``{"class": "CharacterTargets", "vocab_file": ..., "unknown_label": None}``;
* ``stats.json``: the sizes asked for and what was made (utterances, hours, seconds taken).

A second run with the same sizes and seed reuses the corpus. benchmarks/configs/speech_ctc.config
trains a BLSTM-CTC model on it (``SPEECH_CORPUS`` names the folder).

    python benchmarks/speech_corpus.py [--out ~/.cache/returnn_tpu/speech] [--train 2000] [--dev 200] [--seed 1]

Needs the Debian package ``espeak-ng`` and the Python packages ``soundfile`` and ``scipy`` (and
``librosa`` to read the corpus back with MFCC features, as ``--smoke`` and the config do).
``--smoke`` makes a tiny corpus (12 train, 4 dev) in a temporary folder and reads it back with
RETURNN's ``OggZipDataset`` and the config's feature options: the test of this code.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Dict, List, Tuple

DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "returnn_tpu", "speech")
BROWN = os.path.join(os.path.expanduser("~"), ".cache", "returnn_tpu", "brown")
SAMPLE_RATE = 16000
ESPEAK_RATE = 22050
CHARACTERS = [" ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOICES = ["en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us-nyc", "en-gb-x-gbclan"]
VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5"]
SPEEDS = (130, 200)  # espeak-ng -s, words per minute
PITCHES = (30, 70)  # espeak-ng -p, 0-99
MIN_WORDS, MAX_WORDS = 3, 20
# The feature extraction of benchmarks/configs/speech_ctc.config, for reading the corpus back.
AUDIO = {"features": "mfcc", "num_feature_filters": 40, "window_len": 0.025, "step_len": 0.010,
         "norm_mean": "per_seq", "norm_std_dev": "per_seq"}
_WORD = re.compile(r"^[a-z]+(?:'[a-z]+)*$")


def normalize(sentence: str):
    """The sentence as a-z, space and apostrophe, or None if it cannot be said as written:
    ``Atlanta's recent primary election , `` no evidence ''`` -> ``atlanta's recent primary election no evidence``."""
    words = []
    for token in sentence.lower().replace("-", " ").split():
        if not re.search(r"[a-z0-9]", token):
            continue  # punctuation and quotes: `` '' , . ; ? !
        if re.search(r"[0-9]", token) or "." in token.rstrip("."):
            return None  # numbers, abbreviations (mr. jr. u.s.): espeak-ng would not say them as written
        token = token.strip("'.")
        if not _WORD.match(token):
            return None  # other characters (& $ % /) or stray apostrophes
        words.append(token)
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return None
    return " ".join(words)


def pick_sentences(path: str, count: int, seed: int) -> List[str]:
    """``count`` normalized sentences of the file, drawn by a seeded shuffle: distinct while the
    file has enough (the Brown training text has about 29,000), then the shuffled list again from
    its start. A repeated sentence is another utterance: its voice, speed and pitch are drawn anew
    (``speak``'s seed is the utterance's index), as a corpus read by several speakers would have."""
    with open(path, encoding="utf-8") as f:
        found = dict.fromkeys(s for s in (normalize(line) for line in f) if s)
    sentences = sorted(found)
    random.Random(seed).shuffle(sentences)
    if not sentences:
        raise SystemExit(f"speech_corpus.py: {path} has no usable sentence")
    if len(sentences) < count:
        print(f"speech_corpus.py: {path} has {len(sentences)} usable sentences; {count} utterances repeat them "
              f"with other voices", file=sys.stderr)
    return [sentences[index % len(sentences)] for index in range(count)]


def speak(job: Tuple[str, str, str]) -> Tuple[str, bytes, float, float]:
    """One utterance: (name, Ogg Vorbis bytes at 16 kHz, duration in seconds, seconds taken).
    ``job`` is (name, text, RNG seed string): the voice, speed and pitch come from the seed."""
    import numpy
    import scipy.signal
    import soundfile

    name, text, seed = job
    start = time.perf_counter()
    rng = random.Random(seed)
    voice = rng.choice(VOICES) + rng.choice(VARIANTS)
    command = ["espeak-ng", "-v", voice, "-s", str(rng.randint(*SPEEDS)), "-p", str(rng.randint(*PITCHES)),
               "--stdout", text]
    result = subprocess.run(command, capture_output=True, timeout=120)
    if result.returncode != 0 or not result.stdout:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.decode(errors='replace')[-300:]}")
    audio, rate = soundfile.read(io.BytesIO(result.stdout), dtype="float32")
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    if rate != SAMPLE_RATE:
        gcd = numpy.gcd(rate, SAMPLE_RATE)
        audio = scipy.signal.resample_poly(audio, SAMPLE_RATE // gcd, rate // gcd).astype("float32")
    audio = numpy.clip(audio, -1.0, 1.0)
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, SAMPLE_RATE, format="OGG", subtype="VORBIS")
    return name, buffer.getvalue(), len(audio) / SAMPLE_RATE, time.perf_counter() - start


def write_part(out: str, part: str, sentences: List[str], seed: int, pool) -> Dict[str, float]:
    """``out/PART.zip`` (written under a temporary name, then renamed); returns its statistics."""
    start = time.perf_counter()
    jobs = [(f"{index:06d}", text, f"{seed}:{part}:{index}") for index, text in enumerate(sentences)]
    entries, busy, total = [], 0.0, 0.0
    path = os.path.join(out, part + ".zip")
    partial = path + ".partial"
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as archive:  # Ogg is compressed already
        for (name, ogg, duration, taken), (_, text, _) in zip(pool.imap(speak, jobs, chunksize=4), jobs):
            archive.writestr(f"{part}/{name}.ogg", ogg)
            entries.append({"text": text, "duration": round(duration, 3), "file": f"{name}.ogg",
                            "seq_name": f"{part}/{name}"})
            busy += taken
            total += duration
        archive.writestr(f"{part}.txt", "[\n" + "".join(f"{entry!r},\n" for entry in entries) + "]\n")
    os.replace(partial, path)
    return {"utterances": len(entries), "hours": round(total / 3600, 4),
            "seconds": round(time.perf_counter() - start, 1),
            "seconds_per_utterance": round(busy / max(1, len(entries)), 4), "zip_bytes": os.path.getsize(path)}


def make(out: str, sizes: Dict[str, int], seed: int, brown: str = BROWN, processes: int = 2) -> Tuple[dict, bool]:
    """The corpus in ``out`` (made, or found there with the same sizes and seed): (stats, reused)."""
    stats_path = os.path.join(out, "stats.json")
    wanted = {"sizes": sizes, "seed": seed, "characters": CHARACTERS}
    if os.path.exists(stats_path):
        with open(stats_path) as f:
            stats = json.load(f)
        if {key: stats.get(key) for key in wanted} == wanted and all(
                os.path.exists(os.path.join(out, name)) for name in ["chars.vocab"] + [p + ".zip" for p in sizes]):
            return stats, True
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "chars.vocab"), "w", encoding="utf-8") as f:
        f.write("{\n" + "".join(f"{char!r}: {index},\n" for index, char in enumerate(CHARACTERS)) + "}\n")
    stats = dict(wanted)
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with context.Pool(processes) as pool:
        for part, count in sizes.items():
            sentences = pick_sentences(os.path.join(brown, part + ".txt"), count, seed)
            stats[part] = write_part(out, part, sentences, seed, pool)
    with open(stats_path, "w") as f:
        json.dump(stats, f, indent=1)
    return stats, False


def make_tiny(out: str, brown: str = BROWN) -> dict:
    """The tests' corpus in ``out``: 12 train and 4 dev utterances (seed 1), spoken from the Brown
    corpus if benchmarks/corpus.py prepared it, else from that script's own tiny text."""
    if not os.path.exists(os.path.join(brown, "train.txt")):
        from corpus import prepare, write_tiny_corpus  # noqa: the sibling script
        brown = os.path.join(out, "brown")
        write_tiny_corpus(os.path.join(brown, "tiny"))
        prepare(os.path.join(brown, "tiny"), brown, 100)
    return make(out, {"train": 12, "dev": 4}, 1, brown=brown)[0]


def read_back(out: str, parts: List[str], num_seqs: int = 3) -> List[dict]:
    """Loads the first ``num_seqs`` of each part with RETURNN's OggZipDataset (the config's features)."""
    from returnn.datasets.audio import OggZipDataset

    rows = []
    for part in parts:
        dataset = OggZipDataset(path=os.path.join(out, part + ".zip"), audio=AUDIO,
                                targets={"class": "CharacterTargets", "vocab_file": os.path.join(out, "chars.vocab"),
                                         "unknown_label": None},
                                seq_ordering="sorted_reverse")
        dataset.initialize()
        dataset.init_seq_order(epoch=1)
        dataset.load_seqs(0, num_seqs)
        for seq_idx in range(num_seqs):
            features = dataset.get_data(seq_idx, "data")
            classes = dataset.get_data(seq_idx, "classes")
            assert features.ndim == 2 and features.shape[1] == AUDIO["num_feature_filters"], features.shape
            assert len(classes) > 0
            text = dataset.targets.get_seq_labels(classes)
            rows.append({"part": part, "tag": dataset.get_tag(seq_idx), "frames": features.shape[0],
                         "dim": features.shape[1], "labels": len(classes), "text": text})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the corpus folder (reused if it holds the asked sizes)")
    parser.add_argument("--train", type=int, default=2000, help="training utterances")
    parser.add_argument("--dev", type=int, default=200, help="dev utterances")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--brown", default=BROWN, help="benchmarks/corpus.py's folder (train.txt, dev.txt)")
    parser.add_argument("--smoke", action="store_true", help="12 + 4 utterances in a temporary folder, read back")
    args = parser.parse_args()
    if args.smoke:
        args.out = tempfile.mkdtemp(prefix="speech_smoke_")
        stats, reused = make_tiny(args.out, args.brown), False
    else:
        stats, reused = make(args.out, {"train": args.train, "dev": args.dev}, args.seed, brown=args.brown)
    print(f"{'reused' if reused else 'made'} {args.out} (seed {args.seed}): "
          f"{len(CHARACTERS)} characters in chars.vocab")
    for part in ("train", "dev"):
        p = stats[part]
        print(f"{part}: {p['utterances']} utterances, {p['hours']:.3f} h of audio, {p['seconds']:.1f} s taken, "
              f"{p['zip_bytes'] / 1e6:.2f} MB zip")
    per_utterance = [stats[part]["seconds_per_utterance"] for part in ("train", "dev")]
    print(f"generation: {sum(per_utterance) / 2:.3f} s per utterance in one process (espeak-ng, resampling, "
          f"Vorbis), a pool of 2{' (when made)' if reused else ''}")
    if args.smoke:
        rows = read_back(args.out, ["train", "dev"])
        print("part   tag            frames  dim  labels  text")
        for row in rows:
            print(f"{row['part']:6} {row['tag']:14} {row['frames']:6} {row['dim']:4} {row['labels']:7}  "
                  f"{row['text'][:50]}")
        shutil.rmtree(args.out)


if __name__ == "__main__":
    main()
