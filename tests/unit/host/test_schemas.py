"""Every --json document and results file is valid against its versioned JSON Schema (launcher/schemas)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from launcher import schemas
from tests.nvml_fixtures import GiB, NvmlStub, gpu, machine
from tests.run_fixtures import CliRun

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("schema_id", schemas.ALL)
def test_schemas_are_valid_and_name_their_version(schema_id: str) -> None:
    schema = schemas.load(schema_id)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema"] == {"const": schema_id} and "schema" in schema["required"]


def test_up_json_result_file_status_and_plan(trained_cartpole: CliRun) -> None:
    assert trained_cartpole.returncode == 0, trained_cartpole.stderr[-3000:]
    run = trained_cartpole.run_dir
    result = trained_cartpole.result  # stdout is the document and nothing else
    jsonschema.validate(result, schemas.load(schemas.RESULT_SCHEMA))
    assert result == json.loads((run / "result.json").read_text())
    assert (result["state"], result["exit_code"], result["run_id"]) == ("finished", 0, run.name)
    assert result["results_dir"] == str(run.resolve()) and result["summary"]["target_reached"] is True
    status = json.loads((run / "status.json").read_text())
    jsonschema.validate(status, schemas.load(schemas.STATUS_SCHEMA))
    plan = json.loads((run / "plan.json").read_text())
    jsonschema.validate(plan, schemas.load(schemas.PLAN_SCHEMA))


def test_a_wrong_document_is_rejected() -> None:
    bad = {"schema": "launcher.result/v1", "run_id": "r", "state": "exploded", "exit_code": 0}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schemas.load(schemas.RESULT_SCHEMA))


def test_gpus_and_plan_json_on_a_simulated_machine(nvml_stub: NvmlStub) -> None:
    cfg = machine(2)
    cfg["gpus"].append(gpu(2, used_bytes=70 * GiB, util_pct=95))
    nvml_stub.configure(cfg)
    env = nvml_stub.env()
    for args, schema_id in ((["gpus", "--json", "--no-docker"], schemas.GPUS_SCHEMA),
                            (["plan", "--workers", "16", "--json", "--sample-interval", "0"], schemas.PLAN_SCHEMA),
                            (["plan", "--workers", "4", "--gpus", "none", "--json"], schemas.PLAN_SCHEMA)):
        out = subprocess.run([sys.executable, "-m", "launcher", *args], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        jsonschema.validate(doc, schemas.load(schema_id))
        assert doc["schema"] == schema_id


def test_status_json(trained_cartpole: CliRun) -> None:
    run = trained_cartpole.run_dir
    one = subprocess.run([sys.executable, "-m", "launcher", "status", run.name, "--results",
                          str(trained_cartpole.root), "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert one.returncode == 0, one.stderr
    doc = json.loads(one.stdout)
    schemas.validator(schemas.RUN_STATUS_SCHEMA).validate(doc)
    assert (doc["run_id"], doc["state"], doc["live"]) == (run.name, "finished", False)
    every = subprocess.run([sys.executable, "-m", "launcher", "status", "--results", str(trained_cartpole.root),
                            "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert every.returncode == 0, every.stderr
    listing = json.loads(every.stdout)
    # The list names its own schema (it used to claim launcher.status/v1, the master's status.json id).
    assert listing["schema"] == schemas.STATUS_LIST_SCHEMA == "launcher.status-list/v2"
    schemas.validator(schemas.STATUS_LIST_SCHEMA).validate(listing)
    for item in listing["runs"]:
        schemas.validator(schemas.RUN_STATUS_SCHEMA).validate(item)
        assert all(p["state"] in ("starting", "running", "restarting", "exited", "failed", "lost") for p in item["parts"])
    # The listing is every run under the root plus any run the Docker engine knows by label with its results
    # elsewhere (lifecycle.view_runs): another test's live container run may show, never a second run of this root.
    root = trained_cartpole.root.resolve()
    here = [r["run_id"] for r in listing["runs"] if Path(r["results"]).resolve().is_relative_to(root)]
    assert here == [run.name], listing["runs"]
    assert listing["runs"][0]["run_id"] == run.name  # the root's own runs come first
