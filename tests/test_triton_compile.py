"""The compile matrix of VCA's Triton kernels (bench.triton_compile) and the table of configurations that fail to
compile, which the kernels' autotuning lists leave out (dit_vca.triton_exclusions).

The full matrix (thousands of compilations) runs by hand and its rows are committed; here: the table follows from
the committed rows and keeps every kernel a configuration; the kernels, their launches and configurations are
those the rows were compiled from (found again by running a VCA layer); the autotuning lists leave out what the
table says; and a sample is compiled for real with every Triton version and must come out as recorded (each
recorded failure kind with the version it failed with). The other Triton versions are installed by
`make triton-versions` (CI does); without them their samples skip, unless VCA_REQUIRE_TRITON_VERSIONS=1 (CI).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from bench import triton_compile as matrix
from bench._harness import RESULTS
from dit_vca import triton_exclusions

RESULTS_FILE = RESULTS / f"{matrix.STEM}.json"
RERUN = "run `python -m bench.triton_compile` (it compiles only what is missing; docs/benchmarks.md)"
REQUIRE_VERSIONS = os.environ.get("VCA_REQUIRE_TRITON_VERSIONS") == "1"


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RESULTS_FILE.read_text())


@pytest.fixture(scope="module")
def table() -> dict:
    return triton_exclusions.load_table()


def recorded_jobs(results: dict) -> tuple[list[dict], dict[str, dict]]:
    """The matrix's jobs over the committed specs, targets and versions, and the committed rows by key."""
    discovery = {"specs": list(results["specs"].values())}
    targets = list(results["coverage"])
    jobs = matrix.plan(discovery, targets, list(results["versions"]))
    rows = {row[0]: dict(zip(results["columns"], row)) for row in results["rows"]}
    return jobs, rows


def test_table_is_what_the_recorded_rows_say(results, table):
    """The committed table is the one the committed rows give: every failure excluded, nothing else."""
    jobs, rows = recorded_jobs(results)
    discovery = {"specs": list(results["specs"].values()), "switches": results["discovery"]["switches"]}
    assert matrix.exclusion_table(discovery, jobs, rows) == table


def test_no_kernel_is_left_without_a_configuration(results, table):
    """For every covered case (target, Triton version, precision, head dim) and every launch in it (kernel,
    switches) one configuration at least is left in the autotuning list that compiled and fits the target's
    shared memory."""
    jobs, rows = recorded_jobs(results)
    usable = defaultdict(bool)
    for job in jobs:
        target, version, spec = job["target"], job["version"], results["specs"][job["spec"]]
        covered = table["covered"].get(target, {}).get(version, {})
        for precision, d, switches in spec["cases"]:
            if d in covered.get(precision, ()):
                row = rows[job["key"]]
                kept = job["label"] not in table["excluded"].get(target, {}).get(version, {}).get(spec["name"], ())
                fits = row["ok"] and row["shared"] <= matrix.SHARED_LIMITS[target]
                usable[target, version, spec["name"], precision, d, tuple(switches)] |= kept and fits
    left_without = [case for case, ok in usable.items() if not ok]
    assert usable and not left_without, left_without


@pytest.mark.slow
def test_matrix_is_in_step_with_the_kernels(results, table):
    """The kernels found by running a VCA layer now, their sources, configurations and launches, are those the
    committed rows were compiled from, in every covered case: a kernel changed, added or launched differently
    without a rerun of the matrix fails here, saying what changed."""
    discovery = matrix.discover()
    changed = sorted(
        name
        for name in discovery["kernels"].keys() | table["kernels"].keys()
        if discovery["kernels"].get(name) != table["kernels"].get(name, {}).get("source")
    )
    assert not changed, f"kernels changed, added or removed since the matrix ran: {changed}; {RERUN}"
    declared = {s["name"]: [matrix.config_label(c) for c in s["configs"]] for s in discovery["specs"]}
    recorded = {name: kernel["configs"] for name, kernel in table["kernels"].items()}
    assert declared == recorded, f"autotuning configurations changed since the matrix ran; {RERUN}"
    cases = {spec["id"]: spec["cases"] for spec in discovery["specs"]}
    jobs = []
    for target, versions in table["covered"].items():
        for version, covered in versions.items():
            for job in matrix.plan(discovery, [target], [version]):
                if any(d in covered.get(precision, ()) for precision, d, _ in cases[job["spec"]]):
                    jobs.append(job)
    assert jobs, f"no case is covered; {RERUN}"
    recorded_keys = {row[0] for row in results["rows"]}
    missing = [
        f"{j['kernel']} {j['label']} {j['target']} {j['version']}" for j in jobs if j["key"] not in recorded_keys
    ]
    assert not missing, f"{len(missing)} launches not compiled by the matrix, e.g. {missing[:3]}; {RERUN}"


LOOKUP = """
import importlib, json, sys
import torch, triton
from pathlib import Path
from dit_vca import triton_exclusions
from dit_vca.triton_exclusions import config_name

lists = {}
for table, target, version in json.loads(sys.argv[1]):
    triton_exclusions.TABLE = Path(table)
    triton_exclusions.load_table.cache_clear()
    capability = (int(target[3:-1]), int(target[-1]))  # "sm_100": (10, 0)
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None, capability=capability: capability
    triton.__version__ = version
    kernels = importlib.reload(importlib.import_module("dit_vca.vca_triton"))
    lists[f"{table} {target} {version}"] = {
        name: [config_name(c.kwargs, c.num_warps, c.num_stages) for c in value.configs]
        for name, value in vars(kernels).items() if isinstance(value, triton.runtime.Autotuner)
    }
print(json.dumps(lists))
"""


@pytest.mark.slow
def test_autotuning_lists_leave_out_what_the_table_excludes(table, tmp_path):
    """dit_vca.vca_triton compiled (no interpreter) on a GPU of a given target with a given Triton (both faked: the
    capability and triton.__version__): each kernel's autotuning list is its declared one less the table's
    exclusions for that (target, version), and all of it for a target the table does not cover. A table that
    excludes another configuration of each kernel shows that each kernel's list is filtered by its own name."""
    declared = {name: kernel["configs"] for name, kernel in table["kernels"].items()}
    synthetic, exclusions = json.loads(json.dumps(table)), {}
    tunable = sorted((name, configs) for name, configs in declared.items() if len(configs) > 1)
    for index, (name, configs) in enumerate(tunable):
        subsets = [list(s) for size in range(1, len(configs)) for s in itertools.combinations(configs, size)]
        exclusions[name] = subsets[index % len(subsets)]  # as unlike between kernels as the lists allow
    synthetic["excluded"] = {"sm_90": {"0.0.1": exclusions}}
    (tmp_path / "synthetic.json").write_text(json.dumps(synthetic))
    real = str(triton_exclusions.TABLE)
    platforms = [(real, t, v) for t, versions in table["excluded"].items() for v in versions]
    platforms += [(real, "sm_86", "3.6.0"), (str(tmp_path / "synthetic.json"), "sm_90", "0.0.1")]
    environment = matrix.compiler_environment(matrix.venv_version(), tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", LOOKUP, json.dumps(platforms)], cwd=matrix.ROOT, env=environment,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lists = json.loads(done.stdout)
    assert any(len(configs) < len(declared[name]) for configs in lists.values() for name, configs in configs.items())
    for path, target, version in platforms:
        excluded = json.loads(open(path).read())["excluded"].get(target, {}).get(version, {})
        autotuned = lists[f"{path} {target} {version}"]
        assert autotuned.keys() <= declared.keys() and len(autotuned) >= len(tunable), (autotuned.keys(), tunable)
        expected = {name: [c for c in declared[name] if c not in excluded.get(name, ())] for name in autotuned}
        assert autotuned == expected, (target, version)


def sample_jobs(results: dict, version: str) -> list[dict]:
    """What the sample compiles with one Triton version: the quickest row that compiled (for sm_90 where one did),
    and for each target and error that version failed with, the quickest row that failed so."""
    rows = [dict(zip(results["columns"], row)) for row in results["rows"] if row[4] == version]
    compiled = [r for r in rows if r["ok"]]
    chosen = [min([r for r in compiled if r["target"] == "sm_90"] or compiled, key=lambda r: r["seconds"])]
    failures = defaultdict(list)
    for row in rows:
        if not row["ok"]:
            failures[row["target"], row["error"]].append(row)
    chosen += [min(group, key=lambda r: r["seconds"] or 0) for group in failures.values()]
    jobs = []
    for row in chosen:
        spec = results["specs"][row["spec"]]
        config = next(c for c in spec["configs"] if matrix.config_label(c) == row["config"])
        jobs.append(matrix.job(spec, config, row["target"], version))
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("version", [*matrix.PINNED, matrix.venv_version()])
def test_sample_compiles_as_recorded(results, version, tmp_path):
    """A real compilation per Triton version (its own folder, a fresh Triton cache) gives the committed row: the
    same shared memory, registers and spills, or the same error (the known failures still fail)."""
    if matrix.missing_versions([version]):
        message = f"Triton {version} is not installed in {matrix.VERSIONS_DIR}: run `make triton-versions`"
        if REQUIRE_VERSIONS:
            pytest.fail(message)
        pytest.skip(message)
    if not any(row[4] == version for row in results["rows"]):
        pytest.skip(f"the committed matrix has no rows for Triton {version}")
    jobs = sample_jobs(results, version)
    compiled: dict[str, dict] = {}
    matrix.compile_jobs(jobs, version, compiled, row_log=tmp_path / "rows.jsonl")
    recorded = {row[0]: dict(zip(results["columns"], row)) for row in results["rows"]}
    fields = ("ok", "error", "shared", "registers", "spill_stores", "spill_loads")
    for job in jobs:
        assert {f: compiled[job["key"]][f] for f in fields} == {f: recorded[job["key"]][f] for f in fields}, job


def test_a_missing_triton_version_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        matrix.main(["--versions", "0.0.1"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: Triton 0.0.1 not installed in" in error and "--install" in error, error


def test_a_kernel_edited_since_its_launches_were_recorded_stops_the_run(results, tmp_path, capsys):
    """A job whose recorded source is not the kernel's now (the file was edited after discover()) is never compiled
    nor recorded, least of all as a failure that the autotuning lists would leave out: the worker refuses every
    job before compiling any, and the run stops with one line naming the kernel."""
    spec = next(spec for spec in results["specs"].values() if spec["configs"][0]["params"])
    stale = matrix.job(spec | {"source": "0" * 16}, spec["configs"][0], "sm_90", matrix.venv_version())
    row_log = tmp_path / "rows.jsonl"
    rows: dict[str, dict] = {}
    with pytest.raises(SystemExit) as stop:
        matrix.compile_jobs([stale], matrix.venv_version(), rows, row_log=row_log)
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and spec["kernel"] in error[0] and "run the matrix again" in error[0], error
    assert rows == {} and (not row_log.exists() or row_log.read_text() == "")
