"""JSON Schemas (draft 2020-12) of every ``--json`` document and results file the launcher writes.

Each document carries ``"schema": "launcher.<name>/v<N>"``; the matching schema is ``<name>.v<N>.json``
in this package. A change that removes or retypes a field bumps ``N``; adding a field does not (the
schemas allow extra properties), so a consumer written against v1 keeps working.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

RESULT_SCHEMA = "launcher.result/v1"  # launcher up --json, <run>/result.json
PLAN_SCHEMA = "launcher.plan/v2"  # launcher plan --json, <run>/plan.json
GPUS_SCHEMA = "launcher.gpus/v1"  # launcher gpus --json
STATUS_SCHEMA = "launcher.status/v1"  # <run>/status.json (the master)
RUN_STATUS_SCHEMA = "launcher.run-status/v2"  # launcher status RUN --json
STATUS_LIST_SCHEMA = "launcher.status-list/v2"  # launcher status --json (every run)
RUNS_SCHEMA = "launcher.runs/v1"  # launcher runs --json
EVAL_SCHEMA = "launcher.eval/v1"  # launcher eval --json
CONFIG_SCHEMA = "launcher.config-show/v1"  # launcher config show --json
CHECK_SCHEMA = "launcher.check/v1"  # launcher check --json

ALL = (RESULT_SCHEMA, PLAN_SCHEMA, GPUS_SCHEMA, STATUS_SCHEMA, RUN_STATUS_SCHEMA, STATUS_LIST_SCHEMA, RUNS_SCHEMA,
       EVAL_SCHEMA, CONFIG_SCHEMA, CHECK_SCHEMA)


def file_name(schema_id: str) -> str:
    """``launcher.plan/v2`` -> ``plan.v2.json``."""
    name, _, version = schema_id.removeprefix("launcher.").partition("/")
    return f"{name}.{version}.json"


@cache
def load(schema_id: str) -> dict[str, Any]:
    """The JSON Schema of ``schema_id`` (e.g. ``launcher.plan/v2``). Raises FileNotFoundError if unknown."""
    text = resources.files(__name__).joinpath(file_name(schema_id)).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def validator(schema_id: str) -> Any:
    """A ``jsonschema`` validator for ``schema_id`` that resolves references to the other launcher schemas
    (needs the ``jsonschema`` package, a test dependency)."""
    import jsonschema
    from referencing import Registry, Resource

    registry: Registry[Any] = Registry().with_resources(
        (load(sid)["$id"], Resource.from_contents(load(sid))) for sid in ALL)
    return jsonschema.Draft202012Validator(load(schema_id), registry=registry)
