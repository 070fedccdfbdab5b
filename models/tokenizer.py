"""Loading a local tokenizer.json (the `tokenizers` library) with a one-line error."""

from __future__ import annotations

import os


def load_tokenizer(path: str, error: type[Exception] = ValueError):
    """The tokenizer in file `path`; a missing or unreadable file raises `error` in one line."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise error(f"tokenizer file {path!r} does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise error(f"cannot load tokenizer {path!r}: {str(e).splitlines()[0]}") from None
