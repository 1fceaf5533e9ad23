"""Write the configuration reference (docs/reference/configuration.md: a Markdown table of every GRPOConfig field,
its default and its help text) from the dataclass itself. `python scripts/config_reference.py` rewrites the page;
`--check` fails if the page is stale (tests/test_docs.py runs the same comparison)."""

import dataclasses
import sys
from pathlib import Path

from grpokit.config import GRPOConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "configuration.md"

HEADER = """# Configuration reference

Every field of `GRPOConfig`. Each is also a flag of `grpokit train` (`--learning_rate 1e-5`) and a key of its YAML
file ([the command line and YAML](../guides/cli.md)). Names and defaults follow TRL 1.16's `GRPOConfig` and
transformers' `TrainingArguments`, except where grpokit
[differs on purpose](../guides/from-trl.md#where-grpokit-differs-from-trl). Fields TRL has and grpokit does not
implement warn by name when set; deprecated names still work and warn naming the replacement.

This page is generated from the dataclass's field help by `python scripts/config_reference.py`.

"""


def config_reference() -> str:
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(GRPOConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{default!r}` | {help_text} |")
    return "\n".join(rows)


def config_reference_page() -> str:
    return HEADER + config_reference() + "\n"


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        if PAGE.read_text() != config_reference_page():
            sys.exit(f"{PAGE} is stale: run python scripts/config_reference.py")
    else:
        PAGE.write_text(config_reference_page())
        print(f"wrote {PAGE}")
