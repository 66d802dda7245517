"""The compile matrix of VCA's Triton kernels (bench.triton_compile) against the kernels' declared tile
configurations (dit_vca.vca_triton_configs), and the checks it makes possible without a GPU.

The matrix (hundreds of compilations) runs by hand and its summary is committed; here: no compiled kernel has an
atomic instruction or a GPU-scope memory fence (the detectors themselves checked on a kernel that has both); the
configuration each covered case runs compiled there within the target's shared memory, and on sm_90 in bf16 at
d = 64 and 72 without spills beyond what is declared beside it; every exclusion declared is one the matrix found;
the kernels, their sources and configurations are those the summary was compiled from; and a sample is compiled for
real with every Triton version and must come out as recorded. The other Triton versions are installed by
`make triton-versions` (CI does); without them their samples skip, unless VCA_REQUIRE_TRITON_VERSIONS=1 (CI).
"""

from __future__ import annotations

import json
import os

import pytest

from bench import triton_compile as matrix
from bench._harness import RESULTS
from bench.triton_launches import SWITCHES, source_hash
from dit_vca.vca_triton_configs import CONFIGS

RESULTS_FILE = RESULTS / f"{matrix.STEM}.json"
RERUN = "run `python -m bench.triton_compile` (docs/triton-compile.md)"
REQUIRE_VERSIONS = os.environ.get("VCA_REQUIRE_TRITON_VERSIONS") == "1"
SPILL_FREE_CASES = (("bf16", 64), ("bf16", 72))  # on sm_90: the head dims of DiT-S/B/L and DiT-XL


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RESULTS_FILE.read_text())


@pytest.fixture(scope="module")
def rows(results) -> list[dict]:
    return [dict(zip(results["columns"], row)) for row in results["rows"]]


@pytest.fixture(scope="module")
def discovery() -> dict:
    """The launches a VCA layer makes now (bench.triton_launches, in a subprocess where Triton compiles)."""
    return matrix.discover()


def covered(row: dict, precision: str, head_dim: int) -> bool:
    return any(case.startswith(f"{precision}/{head_dim}/") for case in row["cases"])


def test_no_compiled_kernel_has_an_atomic_or_a_gpu_fence(rows):
    """Issue 46's first cause, from the compiled code of every row: no atomic instruction in the PTX, no memory fence
    wider than a block in the SASS (the shared-memory fences of wgmma are MEMBAR.ALL.CTA)."""
    compiled = [row for row in rows if row["ok"]]
    assert compiled
    offending = [(r["kernel"], r["target"], r["version"], r["atomics"], r["gpu_fences"]) for r in compiled
                 if r["atomics"] != 0 or r["gpu_fences"] != 0]  # fmt: skip
    assert not offending, offending


def test_every_case_runs_a_configuration_that_compiled_and_fits(results, rows):
    """For every covered (target, Triton version, precision, head dim) and every kernel launched in it, the
    configuration the kernel chooses there compiled and fits the target's shared memory; on sm_90 in bf16 at d = 64
    and 72 it spills at most what is declared beside it (0 for most)."""
    checked = 0
    for target in results["targets"]:
        for version in results["versions"]:
            for precision, head_dim in map(tuple, results["cases"]):
                for kernel in results["configs"]:
                    chosen = CONFIGS[kernel].choose((target, version), precision, head_dim)
                    found = [r for r in rows if (r["kernel"], r["config"], r["target"], r["version"]) ==
                             (kernel, chosen.name, target, version) and covered(r, precision, head_dim)]  # fmt: skip
                    assert found, f"{kernel} {chosen.name} not compiled for {target} {version} {precision} {head_dim}"
                    for row in found:
                        case = (kernel, chosen.name, target, version, precision, head_dim)
                        assert row["ok"] and row["shared"] <= matrix.SHARED_LIMITS[target], (case, row["error"])
                        if target == "sm_90" and (precision, head_dim) in SPILL_FREE_CASES:
                            assert row["spill_stores"] <= chosen.spills, (case, row["spill_stores"], chosen.spills)
                        checked += 1
    assert checked >= len(results["configs"]) * len(results["cases"]), checked


def test_every_declared_exclusion_is_what_the_matrix_found(rows):
    """An exclusion beside a configuration names only platforms and cases where the matrix found that
    configuration failing, over the target's shared memory, or spilling more than it may: a stale one fails here."""
    for kernel, configs in CONFIGS.items():
        for config in configs.compiled:
            for exclusion in config.excluded:
                found = [
                    r for r in rows
                    if (r["kernel"], r["config"]) == (kernel, config.name)
                    and any(exclusion.applies(r["target"], r["version"], *case.split("/")[:1], int(case.split("/")[1]))
                            for case in r["cases"])
                ]  # fmt: skip
                bad = [r for r in found if not r["ok"] or r["shared"] > matrix.SHARED_LIMITS[r["target"]]
                       or r["spill_stores"] > config.spills]  # fmt: skip
                assert bad, (kernel, config.name, exclusion)


@pytest.mark.slow
def test_matrix_is_in_step_with_the_kernels(results, discovery):
    """The kernels a VCA layer launches now, their sources and declared configurations, are those the committed
    summary was compiled from: a kernel changed, added, removed or reconfigured without a rerun fails here, naming
    it and the command."""
    changed = sorted(
        name
        for name in discovery["kernels"].keys() | results["kernels"].keys()
        if discovery["kernels"].get(name) != results["kernels"].get(name)
    )
    assert not changed, f"kernels changed, added or removed since the matrix ran: {changed}; {RERUN}"
    declared = {name: [c.name for c in CONFIGS[name].compiled] for name in sorted(discovery["kernels"])}
    assert declared == results["configs"], f"configurations changed since the matrix ran; {RERUN}"
    assert results["switches"] == "released" and len(SWITCHES) == 4


def sample_jobs(results: dict, rows: list[dict], discovery: dict, version: str) -> list[tuple[dict, dict]]:
    """(job, recorded row) of the sample one Triton version compiles: its quickest row that compiled on sm_90 (or
    anywhere) and, per target and error it failed with, the quickest failed row."""
    mine = [r for r in rows if r["version"] == version]
    compiled = [r for r in mine if r["ok"]]
    chosen = [min([r for r in compiled if r["target"] == "sm_90"] or compiled, key=lambda r: r["seconds"])]
    failures: dict = {}
    for row in mine:
        if not row["ok"]:
            failures.setdefault((row["target"], row["error"]), []).append(row)
    chosen += [min(group, key=lambda r: r["seconds"] or 0) for group in failures.values()]
    jobs = matrix.plan(discovery, list(results["targets"]), [version], [tuple(c) for c in results["cases"]])
    pairs = []
    for row in chosen:
        key = (row["kernel"], row["config"], row["target"], row["cases"])
        pairs.append((next(j for j in jobs if (j["name"], j["label"], j["target"], j["cases"]) == key), row))
    return pairs


@pytest.mark.slow
@pytest.mark.parametrize("version", [*matrix.PINNED, matrix.venv_version()])
def test_sample_compiles_as_recorded(results, rows, discovery, version, tmp_path):
    """A real compilation per Triton version (its own folder, a fresh Triton cache) gives the committed row: the
    same shared memory, registers, spills, atomics and fences, or the same error."""
    if matrix.missing_versions([version]):
        message = f"Triton {version} is not installed in {matrix.VERSIONS_DIR}: run `make triton-versions`"
        if REQUIRE_VERSIONS:
            pytest.fail(message)
        pytest.skip(message)
    if version not in results["versions"]:
        pytest.skip(f"the committed matrix has no rows for Triton {version}")
    pairs = sample_jobs(results, rows, discovery, version)
    compiled: dict[str, dict] = {}
    matrix.compile_jobs([job for job, _ in pairs], version, compiled, row_log=tmp_path / "rows.jsonl")
    fields = ("ok", "error", "shared", "registers", "spill_stores", "atomics", "gpu_fences")
    for job, recorded in pairs:
        assert {f: compiled[job["key"]].get(f) for f in fields} == {f: recorded[f] for f in fields}, job["label"]


@pytest.mark.slow
def test_the_detectors_find_an_atomic_and_the_fence_of_acq_rel(tmp_path, monkeypatch):
    """The worker's counts on a kernel that has what the matrix must find: one atomic add, with Triton's default
    semantics (acq_rel: a GPU-scope fence in the SASS) and relaxed (none)."""
    from _atomic_probe import atomic_add_kernel

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))  # where the worker finds the probe
    version = matrix.venv_version()
    args = {"x": ["tensor", "float32"], "total": ["tensor", "float32"]}
    source = source_hash(atomic_add_kernel)
    jobs = [
        {"key": f"probe-{relaxed}", "kernel": "_atomic_probe:atomic_add_kernel", "source": source,
         "args": args | {"RELAXED": ["value", relaxed]}, "config": {"params": {}, "num_warps": 4, "num_stages": 1},
         "target": "sm_90", "version": version}
        for relaxed in (False, True)
    ]  # fmt: skip
    rows: dict[str, dict] = {}
    matrix.compile_jobs(jobs, version, rows, row_log=tmp_path / "rows.jsonl")
    acq_rel, relaxed = rows["probe-False"], rows["probe-True"]
    assert acq_rel["ok"] and acq_rel["atomics"] > 0 and acq_rel["gpu_fences"] > 0, acq_rel
    assert relaxed["ok"] and relaxed["atomics"] > 0 and relaxed["gpu_fences"] == 0, relaxed


def test_a_missing_triton_version_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        matrix.main(["--versions", "0.0.1"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: Triton 0.0.1 not installed in" in error and "--install" in error, error


def test_a_kernel_edited_since_its_launches_were_recorded_stops_the_run(tmp_path, capsys):
    """A job whose recorded source is not the kernel's now (the file was edited after discover()) is never compiled
    nor recorded: the worker refuses every job before compiling any, and the run stops with one line naming the
    kernel."""
    kernel = "dit_vca.vca_triton_split:pool_backward_kernel"
    stale = {"key": "stale", "kernel": kernel, "source": "0" * 16, "args": {}, "target": "sm_90",
             "config": {"params": {}, "num_warps": 4, "num_stages": 1}, "version": matrix.venv_version()}  # fmt: skip
    row_log = tmp_path / "rows.jsonl"
    rows: dict[str, dict] = {}
    with pytest.raises(SystemExit) as stop:
        matrix.compile_jobs([stale], matrix.venv_version(), rows, row_log=row_log)
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and kernel in error[0] and "run the matrix again" in error[0], error
    assert rows == {} and (not row_log.exists() or row_log.read_text() == "")
