"""Write src/grpokit/trl_fields.json: every field of the installed `trl.GRPOConfig` (TRL's own fields and the
`transformers.TrainingArguments` fields it inherits) with its default, the surface grpokit's GRPOConfig accepts; and
grpokit/trl_distillation_fields.json, the same for `trl.DistillationConfig` (grpokit's DistillationConfig), and
grpokit/trl_rloo_fields.json for `trl.RLOOConfig` (grpokit's RLOOConfig), and grpokit/trl_async_grpo_fields.json for
`trl.experimental.async_grpo.AsyncGRPOConfig` (grpokit's AsyncGRPOConfig).

    python scripts/trl_fields.py           # regenerate the JSON from the installed trl
    python scripts/trl_fields.py --check   # report fields added, removed or with a changed default, and grpokit
                                           # defaults that differ from TRL's without being listed in
                                           # grpokit.config.TRL_DEFAULT_DIFFERENCES; exit 1 on either

Defaults are the dataclass defaults, before TRL's `__post_init__` resolves them (`bf16=None` stays None). A default
that JSON cannot hold is stored as {"repr": "..."}; none of TRL 1.16's needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

JSON_PATH = Path(__file__).resolve().parents[1] / "src" / "grpokit" / "trl_fields.json"
# The same for `trl.DistillationConfig`, the surface of grpokit.distillation_config.DistillationConfig.
DISTILLATION_JSON_PATH = JSON_PATH.with_name("trl_distillation_fields.json")
# And for `trl.RLOOConfig`, the surface of grpokit.rloo.RLOOConfig.
RLOO_JSON_PATH = JSON_PATH.with_name("trl_rloo_fields.json")
# And for `trl.experimental.async_grpo.AsyncGRPOConfig`, the TRL fields of grpokit.async_grpo.AsyncGRPOConfig.
ASYNC_GRPO_JSON_PATH = JSON_PATH.with_name("trl_async_grpo_fields.json")
JSON_PATHS = {
    "GRPOConfig": JSON_PATH,
    "DistillationConfig": DISTILLATION_JSON_PATH,
    "RLOOConfig": RLOO_JSON_PATH,
    "AsyncGRPOConfig": ASYNC_GRPO_JSON_PATH,
}
# Where each config lives in trl (its top level unless named here).
TRL_MODULES = {"AsyncGRPOConfig": "trl.experimental.async_grpo"}


def _jsonable(value):
    try:
        if json.loads(json.dumps(value)) == value:
            return value
    except (TypeError, ValueError):
        pass
    return {"repr": repr(value)}


def installed_fields(config: str = "GRPOConfig") -> dict:
    """{"versions": {...}, "fields": {name: default}} of the installed `trl.<config>`, in declaration order."""
    import importlib

    import torch
    import transformers
    import trl

    fields = {}
    for spec in dataclasses.fields(getattr(importlib.import_module(TRL_MODULES.get(config, "trl")), config)):
        if not spec.init:
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        fields[spec.name] = _jsonable(default)
    # transformers picks optim's default from the torch version (adamw_torch_fused for torch >= 2.8).
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    return {"versions": versions, "fields": fields}


def drift(committed: dict, installed: dict) -> list[str]:
    """One line per field added, removed or whose default changed (committed -> installed)."""
    old, new = committed["fields"], installed["fields"]
    lines = [f"added: {name} (default {new[name]!r})" for name in new if name not in old]
    lines += [f"removed: {name}" for name in old if name not in new]
    lines += [
        f"default changed: {name}: {old[name]!r} -> {new[name]!r}"
        for name in new
        if name in old and old[name] != new[name]
    ]
    return lines


def grpokit_default_differences(committed: dict, config: str = "GRPOConfig") -> list[str]:
    """One line per TRL field whose default in grpokit's `config` is not the committed JSON's, unless listed in
    grpokit.config.TRL_DEFAULT_DIFFERENCES (a deliberate difference with its reason; GRPOConfig only), and per
    listed field whose default is TRL's after all (a stale entry)."""
    import grpokit
    from grpokit.async_grpo import AsyncGRPOConfig
    from grpokit.config import TRL_DEFAULT_DIFFERENCES
    from grpokit.distillation_config import DistillationConfig
    from grpokit.rloo import RLOOConfig

    classes = {
        "GRPOConfig": grpokit.GRPOConfig,
        "DistillationConfig": DistillationConfig,
        "RLOOConfig": RLOOConfig,
        "AsyncGRPOConfig": AsyncGRPOConfig,
    }
    specs = {spec.name: spec for spec in dataclasses.fields(classes[config]) if spec.init}
    # DistillationConfig, RLOOConfig and AsyncGRPOConfig keep every TRL default: no difference is deliberate there.
    allowed = TRL_DEFAULT_DIFFERENCES if config == "GRPOConfig" else {}
    differing = {}
    for name, trl_default in committed["fields"].items():
        if name not in specs:
            continue  # a missing field is `drift`'s business (and tests/test_trl_config.py's)
        spec = specs[name]
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        if _jsonable(default) != trl_default:
            differing[name] = (default, trl_default)
    lines = [
        f"grpokit default differs: {name}: TRL {trl!r}, grpokit {ours!r} (make it TRL's, or list it with its "
        f"reason in grpokit.config.TRL_DEFAULT_DIFFERENCES)"
        for name, (ours, trl) in differing.items()
        if name not in allowed
    ]
    lines += [
        f"listed as differing but equal to TRL's: {name}"
        for name in allowed
        if name in committed["fields"] and name not in differing
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Compare with the committed JSON instead of writing it.")
    options = parser.parse_args(argv)
    status = 0
    for config, path in JSON_PATHS.items():
        installed = installed_fields(config)
        if not options.check:
            path.write_text(json.dumps(installed, indent=1) + "\n")
            print(f"Wrote {len(installed['fields'])} fields of trl {installed['versions']['trl']} to {path}")
            continue
        committed = json.loads(path.read_text())
        lines = drift(committed, installed) + grpokit_default_differences(committed, config)
        if committed["versions"] != installed["versions"]:
            print(f"versions: committed {committed['versions']}, installed {installed['versions']}")
        if lines:
            print("\n".join(lines))
            print(
                f"{len(lines)} difference(s) in {path.name}: update grpokit's {config}, then run "
                "`python scripts/trl_fields.py`."
            )
            status = 1
        else:
            print(f"No drift: {len(installed['fields'])} fields match {path.name}.")
    return status


if __name__ == "__main__":
    sys.exit(main())
