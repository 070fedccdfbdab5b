"""Documents with traceable tokens, and piece widths the packing tests share."""

import numpy as np

# rows of 16 that first-fit decreasing fills exactly (but not 4 rows of 32: test_packing)
EXACT_WIDTHS = [16, 12, 4, 10, 6, 8, 8, 15, 1, 9, 7, 11, 5, 13, 3]
# the same without 1 and 3: every layout of an 8-device set of rows of 128 holds them
SET_WIDTHS = [16, 12, 4, 10, 6, 8, 8, 15, 9, 7, 11, 5, 13]


def documents(lengths, seed=0, vocab=None):
    """Documents of these lengths whose tokens are unique in the step (so each prediction can
    be traced; below `vocab` instead when given), the last token of each an eos (0)."""
    rng = np.random.default_rng(seed)
    values = rng.permutation(np.arange(1, sum(lengths) + 1)).astype(np.int32)
    if vocab is not None:
        values = values % (vocab - 1) + 1
    docs, at = [], 0
    for n in lengths:
        docs.append(np.concatenate([values[at:at + n - 1], [0]]).astype(np.int32))
        at += n
    return docs
