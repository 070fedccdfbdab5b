"""Command line: python train.py --config configs/NAME.yaml [key.sub=value ...]

Exit status 0 on success, 2 with one line on stderr for a config, layout, model or data error
(no traceback), detected before anything compiles.
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config

USAGE = "python train.py --config configs/NAME.yaml [key.sub=value ...]"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", usage=USAGE,
        description="Train a Llama/Qwen model with BASP or Ulysses sequence parallelism.",
    )
    p.add_argument("--config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.steps=100")
    return p


def _fail(kind: str, err: Exception) -> int:
    msg = " ".join(str(err).split()) or type(err).__name__
    print(f"error: {kind}: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        return _fail("config", e)

    # CPU device count and distributed init must precede every JAX backend use.
    from . import runtime

    runtime.configure(cfg)

    from basp_jax import LayoutError
    from models import ModelError

    from .data import DataError
    from .loop import NonFiniteError, run

    try:
        run(cfg)
    except ConfigError as e:
        return _fail("config", e)
    except LayoutError as e:
        return _fail("layout", e)
    except ModelError as e:
        return _fail("model", e)
    except DataError as e:
        return _fail("data", e)
    except NonFiniteError as e:
        _fail("training", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
