"""configs/README.md's reference table is generated from train/config/schema.py and kept up to date."""

import dataclasses
import typing
from pathlib import Path

import pytest

from train.tools import config_doc
from train.config.schema import Config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "configs" / "README.md"


def leaf_keys(cls=Config, prefix=""):
    """Every dotted key of the config, found independently of config_doc."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from leaf_keys(hints[field.name], prefix + field.name + ".")
        else:
            yield prefix + field.name


def test_committed_reference_is_what_the_generator_makes_now():
    text = README.read_text()
    assert text == config_doc.replace_reference(text, config_doc.reference()), (
        f"configs/README.md is out of date with train/config/schema.py; run `{config_doc.COMMAND}`")


def test_every_field_appears_with_a_meaning():
    text = README.read_text()
    keys = list(leaf_keys())
    assert len(keys) > 50 and "runtime.distributed.process_id" in keys
    rows = {row.key: row for row in config_doc.rows()}
    assert list(rows) == keys
    for key in keys:
        assert f"| `{key}` |" in text, key
        assert rows[key].meaning, key
    config_doc.check(list(rows.values()))  # no missing meaning, no stale EXTRA_MEANINGS entry
    assert rows["run.dir"].default == "required"
    assert rows["optimizer.clip_norm"].default == "`1.0`"
    assert rows["train.on_nonfinite"].meaning.startswith("A step whose loss")  # comment above


def test_comments_are_read_from_the_source():
    source = '''
class Section:
    plain: int = 1  # the meaning
    # a block above
    # on two lines
    above: str = "x"  # and more
    long: dict = dict(
        a=1,
    )  # after a call on several lines
    bare: int = 0
'''
    comments = config_doc.field_comments(source)
    assert comments == {("Section", "plain"): "the meaning",
                        ("Section", "above"): "a block above on two lines and more",
                        ("Section", "long"): "after a call on several lines",
                        ("Section", "bare"): ""}


def test_a_field_without_a_comment_fails_naming_it():
    rows = config_doc.rows()
    rows[3] = dataclasses.replace(rows[3], meaning="", commented=False)
    with pytest.raises(config_doc.DocError, match=f"{rows[3].key} has no meaning: add a `# comment`"):
        config_doc.check(rows)


def test_write_needs_the_markers(tmp_path, capsys):
    target = tmp_path / "README.md"
    target.write_text("# configs\n\nno table here\n")
    assert config_doc.main(["--write", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config_doc: ") and err.count("\n") == 1
    target.write_text(f"before\n{config_doc.START}\nold table\n{config_doc.END}\nafter\n")
    assert config_doc.main(["--write", str(target)]) == 0
    text = target.read_text()
    assert text.startswith(f"before\n{config_doc.START}\n<!-- generated") and text.endswith(
        f"|\n{config_doc.END}\nafter\n")
    assert "old table" not in text
