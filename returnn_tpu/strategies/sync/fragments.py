"""Streaming syncs: the parameters split into fragments of about equal bytes."""

from __future__ import annotations

from typing import Dict, List


def split_into_fragments(sizes: Dict[str, int], num_fragments: int) -> List[List[str]]:
    """``num_fragments`` lists of names whose byte sizes are about equal.

    Largest first, each into the fragment with the fewest bytes so far (the greedy rule for equal
    bins; deterministic, so every worker splits alike). A model with fewer parameters than
    fragments leaves some fragments empty.

    >>> split_into_fragments({"a": 8, "b": 4, "c": 4, "d": 1}, 2)
    [['a', 'd'], ['b', 'c']]
    """
    fragments: List[List[str]] = [[] for _ in range(num_fragments)]
    totals = [0] * num_fragments
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        smallest = totals.index(min(totals))
        fragments[smallest].append(name)
        totals[smallest] += sizes[name]
    return [sorted(fragment) for fragment in fragments]
