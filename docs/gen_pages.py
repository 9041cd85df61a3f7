"""Pages generated at build time (mkdocs-gen-files runs this script): the GRPOConfig reference from the
field declarations, the command-line reference from the parsers, and the tutorials from the notebooks.

The notebooks are rendered from ``$GRPO_LAB_DOCS_NOTEBOOKS`` when it names a folder of executed copies
(``make docs`` executes them there first; see ``docs/execute_notebooks.py``), else from ``notebooks/``
without outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

import mkdocs_gen_files

from grpo_lab.cli.commands import build_parser
from grpo_lab.config.field_rules import rule_of
from grpo_lab.config.grpo_config import GRPOConfig
from grpo_lab.config.live import BUILT_PARTS, CHANGE_KINDS

ROOT = Path(__file__).resolve().parents[1]
FIELDS_SOURCE = ROOT / "grpo_lab" / "config" / "fields.py"
SECTION = re.compile(r"^\s*# -+ (?P<title>.+?)\s*$")
FIELD = re.compile(r"^    (?P<name>[a-z_][a-z0-9_]*): ")


def field_sections() -> list[tuple[str, list[str]]]:
    """The groups ``grpo_lab/config/fields.py`` declares its fields in, in its order: (title, names)."""
    sections: list[tuple[str, list[str]]] = []
    for line in FIELDS_SOURCE.read_text().splitlines():
        if match := SECTION.match(line):
            sections.append((match["title"], []))
        elif sections and (match := FIELD.match(line)):
            sections[-1][1].append(match["name"])
    return sections


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _change_text(field: dataclasses.Field) -> str:
    """The field's change rule, linked to its explanation at the top of the page."""
    rule = rule_of(field)
    if rule.change == "build":
        return f"[build](#change-rules) ({rule.builds})"
    return f"[{rule.change}](#change-rules)"


def _heading(title: str) -> str:
    """A section title with its first letter raised, unless it is a name such as vLLM."""
    return title if title[:2] != title[:2].lower() else title[0].upper() + title[1:]


def _escaped(text: str) -> str:
    """Help text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def config_page() -> str:
    fields = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    defaults = GRPOConfig().to_dict()
    lines = [
        "# GRPOConfig", "",
        "Every field of `GRPOConfig`, generated from its declaration (`grpo_lab/config/fields.py`): its type,",
        "default, change rule and documentation (also `GRPOConfig.field_help(name)`, and `--help` on the command",
        "line). Set a field as a keyword, `GRPOConfig(learning_rate=1e-5)`; in a YAML recipe as a key; on a",
        "`grpo-lab train` or generated script's command line as `--learning_rate 1e-5`. The fields implemented",
        "here come first, grouped as they are declared; transformers' other `TrainingArguments` fields, accepted",
        "for TRL scripts' sake, are in the table at the end. How the fields combine:",
        "[configuration](../guides/configuration.md).", "",
        "## Change rules", "",
        "When a field may change in a live session (`session.config.NAME = value` between stages):", "",
    ]
    lines += [f"- **{kind}**: {text}" for kind, text in CHANGE_KINDS.items()]
    lines += ["", "A **build** field names what it builds, which decides what loading a saved run with a new value",
              "does:", ""]
    lines += [f"- **{part}**: {text}" for part, text in BUILT_PARTS.items()]
    listed: set[str] = set()
    for title, names in field_sections():
        lines += ["", f"## {_heading(title)}", ""]
        for name in names:
            field = fields[name]
            listed.add(name)
            lines += [
                f"### `{name}`", "",
                f"`{_type_name(field.type)}`, default `{defaults[name]!r}`, change: {_change_text(field)}.", "",
                field.metadata["help"], "",
            ]
    others = [name for name in fields if name not in listed]
    lines += ["", "## Other TrainingArguments fields", "",
              "The installed transformers' other `TrainingArguments` fields, with transformers' defaults: TRL's",
              "`GRPOConfig` inherits them, so a TRL script may set them. Each help text ends with what grpo_lab does",
              "with the field: implemented, accepted as TRL accepts it (no effect there either), accepted with a",
              "warning that names why it has no effect, or refused with the reason.", "",
              "| field | default | help |", "|---|---|---|"]
    lines += [f"| `{name}` | `{_escaped(repr(defaults.get(name)))}` | {_escaped(fields[name].metadata['help'])} |"
              for name in others]
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its sub-parsers in this one private place
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_page() -> str:
    parser = build_parser()
    lines = ["# The command line", "", "`grpo-lab` (installed with the package; `python -m grpo_lab.cli` is the same).",
             "Generated from its parsers.", "", "```text", parser.format_help().rstrip(), "```"]
    for name, sub in _subcommands(parser).items():
        lines += ["", f"## `grpo-lab {name}`", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def without_widgets(notebook: dict) -> dict:
    """``notebook`` without its live widgets: a widget needs a kernel (or a widget manager fetched from a
    CDN) to draw, so the page shows what the dashboard displays beside it for a saved notebook, its
    static picture; an output that was only a widget is left out."""
    notebook.get("metadata", {}).pop("widgets", None)
    for cell in notebook["cells"]:
        kept = []
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                data.pop(WIDGET_VIEW)
                data.pop("text/plain", None)
                if not data:
                    continue
            kept.append(output)
        if cell["cell_type"] == "code":
            cell["outputs"] = kept
    return notebook


def notebooks() -> None:
    executed = os.environ.get("GRPO_LAB_DOCS_NOTEBOOKS")
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        rendered = Path(executed) / source.name if executed else source
        with mkdocs_gen_files.open(f"tutorials/{source.name}", "w") as page:
            json.dump(without_widgets(json.loads(rendered.read_text())), page, indent=1)


with mkdocs_gen_files.open("reference/config.md", "w") as page:
    page.write(config_page())
with mkdocs_gen_files.open("reference/cli.md", "w") as page:
    page.write(cli_page())
notebooks()
