"""The README and docs/ cannot rot: their pictures and relative links exist, the README's Python
example runs, the planner output they show is what the planner prints today, their plot, tokenize
and generate commands parse, and every `section.key=value` they mention is a config key."""

import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from train.tools import plan
from train.config import schema as config
from train.tools import plot

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# the README and the guides it links to, which hold what used to be its later sections
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXT = "\n\n".join(path.read_text() for path in DOCS)


def _commands(prefix: str) -> list[list[str]]:
    """Shell commands in the README and docs/ starting with `prefix` (continuation lines joined)."""
    text = TEXT.replace("\\\n", " ")
    found = re.findall(rf"({re.escape(prefix)}[^`\n]*)", text)
    return [shlex.split(c.strip()) for c in found]


def test_every_image_exists():
    images = [(doc, path) for doc in DOCS
              for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", doc.read_text())]
    assert any(doc.name == "README.md" and doc.parent == ROOT for doc, _ in images)
    for doc, path in images:
        assert (doc.parent / path).is_file(), f"{doc.relative_to(ROOT)}: {path}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    """Each `[text](target)` in README.md and docs/ that is not a URL names a file (or folder)
    that exists, relative to the file that links to it, and a `#fragment` names a heading there."""
    checked = 0
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)  # not in code
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)} links to {target}"
            assert linked.exists(), where
            assert ROOT in linked.parents or linked == ROOT, f"{where}: outside the repository"
            if fragment:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                assert fragment in {_anchor(h) for h in headings}, f"{where}: no such heading"
            checked += 1
    assert checked > 10


def test_plan_output_shown_is_what_the_planner_prints():
    commands = [c for c in _commands("python -m train.tools.plan") if "--model" in c]
    for with_docs in [c for c in commands if "--docs" in c]:  # docs/adaptive.md's, no output shown
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert plan.main(with_docs[3:]) == 0
        assert "\nadaptive over " in out.getvalue(), with_docs
    (cmd,) = [c for c in commands if "--docs" not in c]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan.main(cmd[3:]) == 0
    block = TEXT.split(" ".join(cmd[:4]), 1)[1].split("```")[1]  # the command with --model
    shown = [line.rstrip() for line in block.splitlines() if line.strip()]
    printed = [line.rstrip() for line in out.getvalue().splitlines()]
    assert len(shown) >= 4 and any(line.startswith("pick:") for line in shown)
    for line in shown:
        assert line in printed, f"the docs show a planner line it no longer prints: {line!r}"


def test_the_readme_python_example_runs(tmp_path):
    """The README's library example runs as pasted into a fresh interpreter, arranging its own 8
    CPU devices (not the suite's), and its parallel attention matches the single-device kernel."""
    (block,) = re.findall(r"^```python\n(.*?)^```", README, flags=re.M | re.S)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.split("\n")
    assert "print(layout.groups, layout.sp)" in block and f"# {printed[0]}" in block, printed
    assert printed[0] == "2 4" and float(printed[1]) < 1e-5, printed


def test_plot_commands_parse():
    commands = [c for c in _commands("python -m train.tools.plot") if len(c) > 3]  # not prose naming it
    assert {c[3] for c in commands} >= {"layouts", "bench", "losses"}
    for cmd in commands:
        plot._parser().parse_args(cmd[3:])  # exits (SystemExit) on an unknown flag


def test_tokenize_and_generate_commands_parse():
    from train.tools import generate
    from train.tools import tokenize

    for prefix, parser, count in (("python -m train.tools.tokenize", tokenize._parser, 1),
                                  ("python -m train.tools.generate", generate._parser, 2)):
        commands = [c for c in _commands(prefix) if len(c) > 3]  # not prose naming the module
        assert len(commands) == count, prefix
        for cmd in commands:
            parser().parse_args(cmd[3:])  # exits (SystemExit) on an unknown flag


def test_hf_extra_is_what_checking_an_export_needs():
    """docs/training.md's `.[hf]` installs transformers and the torch the tests use."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    hf = {r.name: r for r in map(Requirement, extras["hf"])}
    test = {r.name: r for r in map(Requirement, extras["test"])}
    assert set(hf) == {"transformers", "torch"}, hf
    assert all(hf[name].specifier == test[name].specifier for name in hf), (hf, test)
    assert '".[hf]"' in (ROOT / "docs" / "training.md").read_text()


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            yield from _keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_config_key_in_the_docs_exists():
    from models import ModelConfig

    # model.shape is a dict of ModelConfig field overrides: model.shape.FIELD is a key too
    keys = set(_keys(config.Config)) | {f"model.shape.{f.name}"
                                        for f in dataclasses.fields(ModelConfig)}
    mentioned = set(re.findall(r"\b((?:run|model|data|train|optimizer|parallel|checkpoint|metrics|"
                               r"runtime|eval|profile)\.[a-z_.]+[a-z_])=",
                               TEXT))  # as in key=value overrides
    assert len(mentioned) > 10
    unknown = sorted(k for k in mentioned if k not in keys)
    assert not unknown, f"README or docs/ name config keys that do not exist: {unknown}"
