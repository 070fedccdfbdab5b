"""The config reference, generated from the dataclasses in train/config/schema.py so it is written once.

    python -m train.tools.config_doc                            # print the Markdown table
    python -m train.tools.config_doc --write configs/README.md  # replace the table between the markers

Every field of Config's sections appears, recursively, with its type and default from the
dataclass and its meaning from the `# comment` on its line in train/config/schema.py or
train/config/runtime_section.py (the runtime section) (or the comment lines
right above it). A comment that starts with "required" makes the default column say so. A field
without a comment is an error naming it; EXTRA_MEANINGS covers the fields that had none when this
was written (config.py belongs to the trainer; a comment there is better than an entry here).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from pathlib import Path

from ..config import runtime_section
from ..config import schema as config
from ..config import tree as config_tree
from ..choices import CHOICES
from ..config.schema import Config

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
COMMAND = "python -m train.tools.config_doc --write configs/README.md"

# Meanings of fields whose line in train/config/schema.py has no comment (or only "required").
# A test fails when an entry here shadows a comment, so each meaning is still written once.
EXTRA_MEANINGS = {
    "run.seed": "initialisation and data order; 0 to 2**32 - 1",
    "model.param_dtype": "storage dtype of the parameters",
    "data.source": "synthetic (a learnable Markov chain, generated), tokens (a token id file), "
                   "text or jsonl (documents, tokenized with data.tokenizer)",
    "data.seq_len": "tokens per row",
    "train.steps": "optimizer steps",
    "optimizer.warmup_steps": "linear warmup from 0 to lr (clamped to train.steps, with a note)",
    "optimizer.b1": "AdamW decay of the first moment",
    "optimizer.b2": "AdamW decay of the second moment",
    "optimizer.eps": "AdamW epsilon",
    "checkpoint.async_save": "write checkpoints in the background while training goes on",
    "checkpoint.save_final": "save after the last step",
    "runtime.distributed.num_processes": "processes in the run, one per host (or JAX_NUM_PROCESSES)",
    "runtime.distributed.process_id": "this process's rank in [0, num_processes) (or JAX_PROCESS_ID)",
}


class DocError(ValueError):
    """The reference cannot be made or written; one line says what to fix."""


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    meaning: str
    commented: bool  # the meaning comes from a comment in train/config/schema.py


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment text of that field in the source: the comments at
    the end of its lines, after any block of whole-line comments directly above it."""
    trailing: dict[int, str] = {}
    whole_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            code_before = tok.line[: tok.start[1]].strip()
            (trailing if code_before else whole_line)[tok.start[0]] = text
    comments = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, line = [], stmt.lineno - 1
            while line in whole_line:
                above.insert(0, whole_line[line])
                line -= 1
            after = [trailing[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in trailing]
            comments[(node.name, stmt.target.id)] = " ".join(above + after)
    return comments


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def _format_value(value) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def rows(cls=Config, prefix: str = "", comments: dict | None = None) -> list[Row]:
    """One Row per leaf field of cls, sections flattened to dotted keys, in declaration order."""
    if comments is None:  # the sections' modules
        comments = {**field_comments(inspect.getsource(config)),
                    **field_comments(inspect.getsource(runtime_section))}
    hints = typing.get_type_hints(cls)
    result = []
    for field in dataclasses.fields(cls):
        key, tp = prefix + field.name, hints[field.name]
        if dataclasses.is_dataclass(tp):
            result += rows(tp, key + ".", comments)
            continue
        comment = comments.get((cls.__name__, field.name), "")
        required = comment.lower().startswith("required")
        meaning = comment[len("required"):].lstrip(":;, ") if required else comment
        type_name = config_tree.type_name(tp)
        if required:  # null is only the "not set" marker of a required key
            type_name = type_name.removesuffix(" or null")
        if key in CHOICES:  # a `str` key that takes a registry's names: list them from it
            type_name, meaning = _choice(key, meaning)
        result.append(Row(
            key=key,
            type=type_name,
            default="required" if required else f"`{_format_value(_default(field))}`",
            meaning=meaning or EXTRA_MEANINGS.get(key, ""),
            commented=bool(meaning),
        ))
    return result


def _choice(key: str, meaning: str) -> tuple[str, str]:
    """The type and meaning of a registry-backed key (train.choices): its names, and the comment
    before the parenthesis that points at the registry, followed by each name's note."""
    choice = CHOICES[key]
    lead = meaning.split(" (the choices:")[0]
    return " | ".join(choice.names()), f"{lead}: {choice.describe()}" if choice.describe else lead


def check(table_rows: list[Row]) -> None:
    """Every field has a meaning, and no EXTRA_MEANINGS entry is stale or hides a comment."""
    for row in table_rows:
        if not row.meaning:
            raise DocError(
                f"config key {row.key} has no meaning: add a `# comment` on its field in "
                f"train/config/schema.py, then run {COMMAND}"
            )
    uncommented = {row.key for row in table_rows if not row.commented}
    for key in EXTRA_MEANINGS:
        if key not in uncommented:
            raise DocError(
                f"train/tools/config_doc.py EXTRA_MEANINGS[{key!r}]: the field now has a comment in "
                f"train/config/schema.py (or no longer exists); delete the entry"
            )


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the Markdown table cell


def shape_rows() -> list[Row]:
    """One Row per field `model.shape` can set: models.ModelConfig's fields, with the comments on
    their lines in models/config.py (a preset or model.hf_path gives the ones without a default)."""
    import models.config

    comments = field_comments(inspect.getsource(models.config))
    hints = typing.get_type_hints(models.ModelConfig)
    result = []
    for field in dataclasses.fields(models.ModelConfig):
        has_default = field.default is not dataclasses.MISSING
        meaning = comments.get(("ModelConfig", field.name), "")
        result.append(Row(key=f"model.shape.{field.name}", type=config_tree.type_name(
            hints[field.name]).replace("NoneType", "null"),
            default=f"`{_format_value(field.default)}`" if has_default else "the preset's",
            meaning=meaning, commented=bool(meaning)))
        if not meaning:
            raise DocError(f"ModelConfig field {field.name} has no meaning: add a `# comment` on "
                           f"its line in models/config.py, then run {COMMAND}")
    return result


def reference() -> str:
    """The generated block: a note on where it comes from and the table."""
    table_rows = rows()
    check(table_rows)
    at = next(i for i, row in enumerate(table_rows) if row.key == "model.shape") + 1
    table_rows[at:at] = shape_rows()
    lines = [
        f"<!-- generated from train/config/schema.py by `{COMMAND}`; edit the comments there, not here -->",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for row in table_rows:
        lines.append(f"| `{row.key}` | {_cell(row.type)} | {_cell(row.default)} "
                     f"| {_cell(row.meaning)} |")
    return "\n".join(lines)


def replace_reference(text: str, block: str, name: str = "the file") -> str:
    """text with everything between the START and END markers replaced by block."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise DocError(f"{name} has no {START} ... {END} markers around the table")
    return text[: start + len(START)] + "\n" + block + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.tools.config_doc",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="MARKDOWN",
                        help=f"replace the table between {START} and {END} in this file")
    args = parser.parse_args(argv)
    try:
        block = reference()
        if args.write is None:
            print(block)
            return 0
        path = Path(args.write)
        try:
            text = path.read_text()
        except OSError as e:
            raise DocError(f"{path}: {e.strerror.lower()}") from None
        updated = replace_reference(text, block, str(path))
        if updated != text:
            path.write_text(updated)
        print(f"{'wrote' if updated != text else 'unchanged:'} {path}")
    except DocError as e:
        print(f"error: config_doc: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
