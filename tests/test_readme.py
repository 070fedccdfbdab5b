"""The README cannot rot: its pictures exist, the planner output it shows is what the planner
prints today, its plot commands parse, and every `section.key=value` it mentions is a config key."""

import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

from basp_jax import plan
from train import config, plot

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _commands(prefix: str) -> list[list[str]]:
    """Shell commands in the README starting with `prefix` (continuation lines joined)."""
    text = README.replace("\\\n", " ")
    found = re.findall(rf"({re.escape(prefix)}[^`\n]*)", text)
    return [shlex.split(c.strip()) for c in found]


def test_every_image_exists():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert images
    for path in images:
        assert (ROOT / path).is_file(), path


def test_plan_output_shown_is_what_the_planner_prints():
    (cmd,) = [c for c in _commands("python -m basp_jax.plan") if "--model" in c]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan.main(cmd[3:]) == 0
    block = README.split(" ".join(cmd[:3]), 1)[1].split("```")[1]
    shown = [line.rstrip() for line in block.splitlines() if line.strip()]
    printed = [line.rstrip() for line in out.getvalue().splitlines()]
    assert len(shown) >= 4 and any(line.startswith("pick:") for line in shown)
    for line in shown:
        assert line in printed, f"README shows a planner line it no longer prints: {line!r}"


def test_plot_commands_parse():
    commands = _commands("python -m train.plot")
    assert {c[3] for c in commands} >= {"layouts", "bench", "losses"}
    for cmd in commands:
        plot._parser().parse_args(cmd[3:])  # exits (SystemExit) on an unknown flag


def test_tokenize_and_generate_commands_parse():
    from models import generate
    from train import tokenize

    for prefix, parser, count in (("python -m train.tokenize", tokenize._parser, 1),
                                  ("python -m models.generate", generate._parser, 2)):
        commands = [c for c in _commands(prefix) if len(c) > 3]  # not prose naming the module
        assert len(commands) == count, prefix
        for cmd in commands:
            parser().parse_args(cmd[3:])  # exits (SystemExit) on an unknown flag


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            yield from _keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_config_key_in_the_readme_exists():
    keys = set(_keys(config.Config))
    mentioned = set(re.findall(r"\b((?:run|model|data|train|optimizer|parallel|checkpoint|metrics|"
                               r"runtime|eval|profile)\.[a-z_.]+[a-z_])=",
                               README))  # as in key=value overrides
    assert len(mentioned) > 10
    unknown = sorted(k for k in mentioned if k not in keys)
    assert not unknown, f"README names config keys that do not exist: {unknown}"
