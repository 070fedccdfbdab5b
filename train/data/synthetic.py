"""Synthetic data: a learnable Markov chain over the vocabulary, and named document-length
distributions for its documents (data.documents), the planner's predictions and benchmarks.

    source = MarkovSource(vocab_size, branching=4, seed=0, documents="longtail")
    steps = sample_steps("longtail", 100, rows=2, seq_len=4096)   # document lengths per step
"""

from __future__ import annotations

import numpy as np

from .sources import row_of


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in keys])


# Named document-length distributions (tokens per document, eos included) for predictions and
# benchmarks: "longtail" is lognormal(mu=6.5, sigma=1.2) + 2 (median ~670 tokens, a few percent
# beyond 8K), "full" documents that each fill a whole row (the control: nothing to adapt to).
DISTRIBUTIONS: dict[str, tuple[float, float] | None] = {"longtail": (6.5, 1.2), "full": None}


def row_documents(rng: np.random.Generator, distribution: str, length: int) -> list[int]:
    """The lengths (tokens, eos included) of the documents of one packed row of `length` tokens
    (seq_len + 1: a row's inputs and its last target), drawn from DISTRIBUTIONS[distribution]
    as a packing pipeline fills a row: documents are added while they fit; the first that does
    not ends the row (it is not kept; the rest is padding) and a document longer than the row
    is cut to it. One document of `length` tokens under "full"."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown document distribution {distribution!r}; use one of "
                         f"{', '.join(DISTRIBUTIONS)}")
    params = DISTRIBUTIONS[distribution]
    if params is None:
        return [length]
    lengths, used = [], 0
    while True:
        n = int(min(rng.lognormal(*params) + 2, length))
        if used + n > length:  # (an empty row takes any: n <= length)
            return lengths
        lengths.append(n)
        used += n


def sample_steps(distribution: str, count: int, *, rows: int, seq_len: int,
                 seed: int = 0) -> list[list[int]]:
    """`count` steps of document lengths, each filling `rows` rows of seq_len + 1 tokens as the
    trainer's synthetic documents (MarkovSource, data.documents) do: row_documents per row.
    Seeded: the same arguments give the same steps."""
    rng = np.random.default_rng(seed)
    return [[n for _ in range(rows) for n in row_documents(rng, distribution, seq_len + 1)]
            for _ in range(count)]


HELD_OUT = 0xE7A1  # the extra key of held-out synthetic rows (Pipeline(held_out=True))
DOCUMENTS = 0xD0C5  # the extra key of a synthetic row's document lengths (data.documents)


class MarkovSource:
    """Rows walked on a fixed random Markov chain; each token has `branching` likely successors."""

    def __init__(self, vocab_size: int, branching: int, seed: int, held_out: bool = False,
                 documents: str | None = None):
        self.doc_lengths = documents  # a DISTRIBUTIONS name: rows of documents
        branching = min(branching, vocab_size)
        table_rng = _rng(seed, 0x5EED)
        self.table = np.stack(
            [table_rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
        )
        weights = 0.5 ** np.arange(branching, dtype=np.float64)  # skewed: lower entropy
        self.probs = weights / weights.sum()
        self.entropy = float(-(self.probs * np.log(self.probs)).sum())
        self.vocab_size = vocab_size
        self.seed = seed
        # held-out rows come from streams keyed (seed, step, row, HELD_OUT): no training row uses
        # a 4-element key, so they never coincide with one
        self.tag = (HELD_OUT,) if held_out else ()

    def rows(self, step: int, row_ids: np.ndarray, length: int) -> np.ndarray:
        out = np.empty((len(row_ids), length), dtype=np.int64)
        for i, r in enumerate(row_ids):
            rng = _rng(self.seed, step, r, *self.tag)
            choice = rng.choice(len(self.probs), size=length - 1, p=self.probs)
            tok = int(rng.integers(self.vocab_size))
            out[i, 0] = tok
            for j in range(1, length):
                tok = self.table[tok, choice[j - 1]]
                out[i, j] = tok
        return out

    def documents(self, step: int, row_ids: np.ndarray, length: int) -> list[list[np.ndarray]]:
        """Each row (walked as `rows` walks it) cut into documents whose lengths (keyed (seed,
        step, row)) follow self.doc_lengths as a packing pipeline fills a row (row_documents):
        per row, the documents' tokens; the rest of the row is padding."""
        raw = self.rows(step, row_ids, length)
        out = []
        for i, r in enumerate(row_ids):
            lengths = row_documents(_rng(self.seed, step, r, DOCUMENTS, *self.tag),
                                    self.doc_lengths, length)
            ends = np.cumsum(lengths)
            out.append(np.split(raw[i, :ends[-1]], ends[:-1]))
        return out

    def document_rows(self, step: int, row_ids: np.ndarray, length: int
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, segment ids) [len(row_ids), length] of the rows of `documents`: segment ids
        number the documents, -1 the padding after the last (token 0), as
        train.data.sources.Packed's rows."""
        rows = [row_of(docs, length) for docs in self.documents(step, row_ids, length)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
