"""Print the configuration reference (a Markdown table of every GRPOConfig field) for the README."""

import dataclasses

from grpokit.config import GRPOConfig


def config_reference() -> str:
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(GRPOConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{default!r}` | {help_text} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_reference())
