"""Benchmark: VCA's Triton kernels compiled for the GPUs and Triton versions users have, without a GPU.

The compile matrix: every kernel of dit_vca/vca_triton.py × every autotuning configuration × GPU targets sm_100
(B200), sm_90 (H100/H200), sm_80 (A100) × Triton 3.6.0 (what torch 2.10 and 2.11 pin), 3.5.1 (torch 2.9.1) and the
venv's own × bf16, fp16, fp32 with TF32 and fp32 IEEE × head dims 64, 72 and 128, for the released switches
(`--all-switches`: all 16 combinations). The kernels and their arguments are found by running a VCA layer
(bench.triton_launches); each (launch, configuration, target, version) is compiled once, by `triton.compile` for
that GPU target in a process of that Triton (bench.triton_worker). Rows: compiled or the error's first line, shared
memory, registers and spilled bytes per thread, compile time.

The other Triton versions live in their own folders under VCA_TRITON_VERSIONS (default ~/.cache/dit-vca/triton),
never in the project's environment: `python -m bench.triton_compile --install` (make triton-versions) installs them.

Compiled results are cached by content (kernel source hash, arguments, configuration, target, version): the
committed bench/results/triton-compile.json and a local log of rows (ROW_LOG) are read first and only what neither
holds is compiled, one worker process at a time; a run stopped anywhere resumes where it stopped. After each
(target, version) block it writes bench/results/triton-compile.{json,md,png} and the table of configurations that
fail to compile per (target, version), dit_vca/triton_exclusions.json, which the kernels' autotuning lists leave out.

Usage: python -m bench.triton_compile [--targets sm_100 sm_90 sm_80] [--versions 3.6.0 ...] [--all-switches]
       python -m bench.triton_compile --quick        # sm_90, the venv's Triton, bf16 at d = 72: a smoke run
       python -m bench.triton_compile --recorded-only   # results and table from the rows compiled so far
       python -m bench.triton_compile --install      # the pinned Triton versions, each into its own folder
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from atomic_files import atomic_output
from bench._harness import benchmark_parser, describe_device, save_results, subplots
from bench.triton_launches import PRECISIONS, STALE_SOURCE
from dit_vca import triton_exclusions
from dit_vca.triton_exclusions import config_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("sm_100", "sm_90", "sm_80")  # compiled in this order: the newest GPUs first
PINNED = {"3.6.0": "torch 2.10, 2.11", "3.5.1": "torch 2.9.1"}  # Triton versions the supported torch versions pin
# The most shared memory one block may use (CUDA C Programming Guide, compute capabilities table): 163 KiB on
# sm_80, 227 KiB on sm_90 and sm_100. A configuration over it compiles, and the autotuner skips it (OutOfResources).
SHARED_LIMITS = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024}
VERSIONS_DIR = Path(os.environ.get("VCA_TRITON_VERSIONS") or Path.home() / ".cache" / "dit-vca" / "triton")
ROW_LOG = VERSIONS_DIR / "compiled-rows.jsonl"  # every row compiled here, by key: the cache a rerun resumes from
STEM = "triton-compile"
COLUMNS = ("key", "spec", "config", "target", "version", "ok", "error", "shared", "registers", "spill_stores",
           "spill_loads", "seconds")  # fmt: skip


def venv_version() -> str:
    return importlib.metadata.version("triton")


def version_folder(version: str) -> Path | None:
    """The folder a Triton version is imported from (first on PYTHONPATH), None for the venv's own."""
    return None if version == venv_version() else VERSIONS_DIR / version


def missing_versions(versions: list[str]) -> list[str]:
    return [v for v in versions if (f := version_folder(v)) is not None and not (f / "triton" / "__init__.py").exists()]


def install(versions: list[str]) -> None:
    """pip-installs each missing version into its own folder (a partial install is never taken for one)."""
    for version in missing_versions(versions):
        folder = version_folder(version)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(partial)]
        subprocess.run([*pip, f"triton=={version}"], check=True)
        partial.rename(folder)


def compiler_environment(version: str, cache: Path) -> dict[str, str]:
    """A subprocess that compiles: Triton `version` first on the path, no interpreter, no GPU visible (so that the
    kernels' autotuning lists are the declared ones), ptxas's report printed, a Triton cache of its own (so that
    every compilation runs and reports)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    folder = version_folder(version)
    if folder is not None:
        environment["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)])
    environment |= {"CUDA_VISIBLE_DEVICES": "", "TRITON_DUMP_PTXAS_LOG": "1", "TRITON_CACHE_DIR": str(cache)}
    return environment | {"OMP_NUM_THREADS": "1"}


def discover(all_switches: bool = False) -> dict:
    """bench.triton_launches.discover() in a subprocess where Triton compiles (the venv's own)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "launches.json"
        command = [sys.executable, "-m", "bench.triton_launches", str(out)] + (
            ["--all-switches"] if all_switches else []
        )
        done = subprocess.run(command, cwd=ROOT, env=compiler_environment(venv_version(), Path(scratch) / "cache"),
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"discovering the kernels' launches failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def config_label(config: dict) -> str:
    """A launch configuration's name (triton_exclusions.config_name); "default" for a kernel that is not
    autotuned and sets no launch options."""
    if not config["params"] and config["num_warps"] is None and config["num_stages"] is None:
        return "default"
    return config_name(config["params"], config["num_warps"], config["num_stages"])


def job(spec: dict, config: dict, target: str, version: str) -> dict:
    """One compilation: a spec in one configuration for one target with one Triton version. Its key is the content
    it compiles (the kernel's source hash among it)."""
    identity = [spec["kernel"], spec["source"], spec["args"], config, target, version]
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return {"key": key, "spec": spec["id"], "kernel": spec["kernel"], "source": spec["source"], "args": spec["args"],
            "config": config, "label": config_label(config), "target": target, "version": version}  # fmt: skip


def plan(discovery: dict, targets: list[str], versions: list[str]) -> list[dict]:
    """Every job of the matrix: each spec in each of its configurations, for each target and version."""
    return [
        job(spec, config, target, version)
        for target in targets
        for version in versions
        for spec in discovery["specs"]
        for config in spec["configs"]
    ]


def block_order(targets: list[str], versions: list[str]) -> list[tuple[str, str]]:
    """(target, version) pairs in compile order: version by version (the pinned ones first) for sm_100 and sm_90,
    then sm_80 (the GPUs a first run is likeliest to meet first)."""
    newest = [t for t in targets if t != "sm_80"]
    return [(t, v) for v in versions for t in newest] + [("sm_80", v) for v in versions if "sm_80" in targets]


def recorded_rows(results_file: Path) -> dict[str, dict]:
    """Rows by key from the committed results and the local row log: what need not be compiled again."""
    rows = {}
    if results_file.exists():
        results = json.loads(results_file.read_text())
        rows |= {row[0]: dict(zip(COLUMNS, row)) for row in results["rows"]}
    return rows | read_row_log(ROW_LOG)


def compile_jobs(jobs: list[dict], version: str, rows: dict[str, dict], row_log: Path = ROW_LOG) -> None:
    """Compiles those of `jobs` (one version's) that `rows` lacks, in worker processes one at a time, which append
    each row to `row_log` as it comes; then adds them to `rows`. A worker that dies (a crash inside the compiler)
    leaves its job as a failed row and another worker goes on with the rest."""
    row_log.parent.mkdir(parents=True, exist_ok=True)
    pending = [job for job in jobs if job["key"] not in rows]
    with tempfile.TemporaryDirectory() as scratch:
        jobs_file, log = Path(scratch) / "jobs.json", Path(scratch) / "worker.log"
        while pending:
            jobs_file.write_text(json.dumps(pending))
            worker = [sys.executable, "-m", "bench.triton_worker", str(jobs_file), str(row_log)]
            with log.open("w") as log_file:
                done = subprocess.run(worker, cwd=ROOT, env=compiler_environment(version, Path(scratch) / "cache"),
                                      stdout=log_file, stderr=subprocess.STDOUT)  # fmt: skip
            output = log.read_text(errors="replace")
            if done.returncode == STALE_SOURCE:  # edited since discover(): its rows would describe other code
                print(f"bench.triton_compile: {output.strip().splitlines()[-1]}", file=sys.stderr)
                raise SystemExit(2)
            if done.returncode != 0 and "compiling " not in output:
                raise RuntimeError(f"the Triton {version} worker failed before compiling:\n{output[-3000:]}")
            rows |= {key: row for key, row in read_row_log(row_log).items() if key in {j["key"] for j in pending}}
            if done.returncode != 0:  # the job it was compiling when it died
                crashed = next(j for j in pending if j["key"] == output.rsplit("compiling ", 1)[1].split()[0])
                row = {k: crashed[k] for k in ("key", "spec", "target", "version")} | {"config": crashed["label"]}
                row |= {"ok": False, "error": f"the compiler process died (exit status {done.returncode})"}
                with row_log.open("a") as rows_file:
                    rows_file.write(json.dumps(row) + "\n")
                rows[row["key"]] = row
            pending = [job for job in pending if job["key"] not in rows]


def read_row_log(row_log: Path) -> dict[str, dict]:
    """Rows by key from a row log (a line cut by a kill is skipped)."""
    if not row_log.exists():
        return {}
    return {
        row["key"]: row
        for row in map(json.loads, filter(lambda line: line.endswith("}"), row_log.read_text().splitlines()))
    }


def coverage(jobs: list[dict], rows: dict[str, dict]) -> dict[str, dict[str, list[int]]]:
    """{target: {version: [rows recorded, rows planned]}}."""
    counts: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for job in jobs:
        counts[job["target"]][job["version"]][0] += job["key"] in rows
        counts[job["target"]][job["version"]][1] += 1
    return {t: dict(v) for t, v in counts.items()}


def covered_cases(discovery: dict, jobs: list[dict], rows: dict[str, dict]) -> dict:
    """{target: {version: {precision: [head dims]}}}: the cases whose every launch was compiled in every
    configuration for that target and version."""
    cases = {spec["id"]: {(c[0], c[1]) for c in spec["cases"]} for spec in discovery["specs"]}
    complete: dict = defaultdict(lambda: defaultdict(lambda: True))
    for job in jobs:
        for case in cases[job["spec"]]:
            complete[job["target"], job["version"]][case] &= job["key"] in rows
    covered: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (target, version), by_case in complete.items():
        for (precision, d), done in sorted(
            by_case.items(), key=lambda item: (list(PRECISIONS).index(item[0][0]), item[0][1])
        ):
            if done:
                covered[target][version][precision].append(d)
    return json.loads(json.dumps(covered))


def exclusion_table(discovery: dict, jobs: list[dict], rows: dict[str, dict]) -> dict:
    """The table dit_vca.triton_exclusions reads: per target, version and kernel the configurations that failed to
    compile in any recorded case; each kernel's source hash and configurations; the cases (precision, head dim)
    whose every launch is recorded, per target and version."""
    excluded: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
    names = {spec["id"]: spec["name"] for spec in discovery["specs"]}
    for job in jobs:
        row = rows.get(job["key"])
        if row is not None and not row["ok"]:
            excluded[job["target"]][job["version"]][names[job["spec"]]].add(job["label"])
    kernels = {}
    for spec in discovery["specs"]:
        kernels[spec["name"]] = {"source": spec["source"], "configs": [config_label(c) for c in spec["configs"]]}
    return {
        "written_by": "python -m bench.triton_compile (docs/benchmarks.md); do not edit by hand",
        "switches": discovery["switches"],
        "kernels": dict(sorted(kernels.items())),
        "covered": covered_cases(discovery, jobs, rows),
        "excluded": {
            t: {v: {k: sorted(c) for k, c in sorted(ks.items())} for v, ks in sorted(vs.items())}
            for t, vs in sorted(excluded.items())
        },
    }


def write_table(table: dict) -> None:
    with atomic_output(triton_exclusions.TABLE) as path:
        path.write_text(json.dumps(table, indent=1) + "\n")


def results_document(discovery: dict, jobs: list[dict], rows: dict[str, dict], versions: list[str]) -> dict:
    planned = [rows[job["key"]] for job in jobs if job["key"] in rows]
    return {
        "benchmark": STEM,
        "date": datetime.date.today().isoformat(),
        "machine": describe_device_name(),
        "versions": {v: PINNED.get(v, "this environment's") for v in versions},
        "shared_limits": SHARED_LIMITS,
        "discovery": {"shape": discovery["shape"], "switches": discovery["switches"]},
        "kernels": discovery["kernels"],
        "specs": {spec["id"]: spec for spec in discovery["specs"]},
        "coverage": coverage(jobs, rows),
        "covered": covered_cases(discovery, jobs, rows),
        "columns": list(COLUMNS),
        "rows": [[row.get(column) for column in COLUMNS] for row in planned],
    }


def describe_device_name() -> str:
    import torch

    return describe_device(torch.device("cpu"))


def _cases_text(cases: list[list]) -> str:
    """ "bf16: d = 64, 72; ieee: d = 64" from a list of [precision, d, switches]."""
    dims = defaultdict(set)
    for precision, d, _ in cases:
        dims[precision].add(d)
    return "; ".join(
        f"{p}: d = {', '.join(map(str, sorted(dims[p])))}" for p in sorted(dims, key=list(PRECISIONS).index)
    )


def markdown(results: dict) -> str:
    rows = [dict(zip(results["columns"], row)) for row in results["rows"]]
    specs = results["specs"]
    limits = results["shared_limits"]
    lines = [
        f"# Triton compile matrix ({results['date']}, {results['machine']}; no GPU: `triton.compile` for each target)",
        "",
        f"Switches: {results['discovery']['switches']}. Triton versions: "
        + ", ".join(f"{v} ({who})" for v, who in results["versions"].items())
        + ". Precisions: bf16, fp16, fp32 with TF32 (tf32) and IEEE (ieee) products.",
        "",
        "| target | Triton | rows compiled / planned | cases complete | failed | over the shared-memory limit "
        "| compile time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for target, versions in results["coverage"].items():
        for version, (done, planned) in versions.items():
            block = [r for r in rows if r["target"] == target and r["version"] == version]
            failed = sum(not r["ok"] for r in block)
            over = sum(r["ok"] and r["shared"] > limits[target] for r in block)
            seconds = sum(r["seconds"] or 0 for r in block)
            complete = results["covered"].get(target, {}).get(version, {})
            cases = "; ".join(f"{p}: d = {', '.join(map(str, ds))}" for p, ds in complete.items()) or "none"
            lines.append(f"| {target} | {version} | {done} / {planned} | {cases} | {failed} | {over} | {seconds:.0f} |")

    def grouped(select, by) -> dict:
        groups: dict = defaultdict(list)
        for r in filter(select, rows):
            groups[(specs[r["spec"]]["name"], r["config"], r["target"], r["version"], *by(r))].append(r)
        return groups

    def cases(group: list[dict]) -> str:
        return _cases_text([case for r in group for case in specs[r["spec"]]["cases"]])

    lines += ["", "## Configurations that fail to compile (left out of the autotuning list there)", ""]
    lines += ["| kernel | configuration | target | Triton | cases | error |", "|---|---|---|---|---|---|"]
    for (kernel, config, target, version, error), group in sorted(
        grouped(lambda r: not r["ok"], lambda r: [r["error"]]).items()
    ):
        lines.append(f"| `{kernel}` | {config} | {target} | {version} | {cases(group)} | {error} |")
    lines += ["", "## Compiled, but over the target's shared memory (the autotuner skips them there)", ""]
    lines += ["| kernel | configuration | target | Triton | cases | shared (KiB) |", "|---|---|---|---|---|---|"]
    over = grouped(lambda r: r["ok"] and r["shared"] > limits[r["target"]], lambda r: [])
    for (kernel, config, target, version), group in sorted(over.items()):
        shared = ", ".join(f"{s / 1024:.0f}" for s in sorted({r["shared"] for r in group}))
        lines.append(f"| `{kernel}` | {config} | {target} | {version} | {cases(group)} | {shared} |")
    versions = list(results["versions"])
    for target in results["coverage"]:
        peaks = grouped(lambda r, target=target: r["ok"] and r["target"] == target, lambda r: [])
        if not peaks:
            continue
        lines += ["", f"## {target}: the most shared memory (KiB), registers and spill stores (bytes) per thread", ""]
        lines += ["over every case (precision, head dim) that compiled.", ""]
        lines += ["| kernel | configuration | " + " | ".join(f"Triton {v}" for v in versions) + " |"]
        lines += ["|---|---|" + "---|" * len(versions)]
        for kernel, config in sorted({key[:2] for key in peaks}):
            cells = []
            for version in versions:
                group = peaks.get((kernel, config, target, version), [])
                shared = max((r["shared"] for r in group), default=None)
                registers = max((r["registers"] or 0 for r in group), default=0)
                spills = max((r["spill_stores"] or 0 for r in group), default=0)
                cells.append("–" if shared is None else f"{shared / 1024:.0f} KiB · {registers} · {spills}")
            lines.append(f"| `{kernel}` | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    """Left: each kernel's largest spill per thread, per (target, version) compiled. Right: compile times."""
    rows = [dict(zip(results["columns"], row)) for row in results["rows"]]
    specs = results["specs"]
    figure, (spills, times) = subplots(1, 2, figsize=(14, 5))
    kernels = sorted({specs[r["spec"]]["name"] for r in rows})
    blocks = [(t, v) for t, versions in results["coverage"].items() for v, (done, _) in versions.items() if done]
    width = 0.8 / max(1, len(blocks))
    for index, (target, version) in enumerate(blocks):
        peak = [
            max((r["spill_stores"] or 0 for r in rows if r["ok"] and (r["target"], r["version"]) == (target, version)
                 and specs[r["spec"]]["name"] == kernel), default=0)
            for kernel in kernels
        ]  # fmt: skip
        spills.bar([k + index * width for k in range(len(kernels))], peak, width, label=f"{target}, Triton {version}")
    spills.set_xticks([k + 0.4 - width / 2 for k in range(len(kernels))], kernels, rotation=60, ha="right", fontsize=7)
    spills.set_yscale("symlog", linthresh=10)
    spills.set_ylabel("largest spill stores per thread (bytes)")
    spills.legend(fontsize=7)
    for target, version in blocks:
        seconds = [r["seconds"] for r in rows if (r["target"], r["version"]) == (target, version) and r["seconds"]]
        times.hist(seconds, bins=30, histtype="step", label=f"{target}, Triton {version} ({len(seconds)} rows)")
    times.set_xlabel("compile time of one kernel configuration (s, one CPU core shared with other jobs)")
    times.set_ylabel("compilations")
    times.legend(fontsize=7)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "sm_90, the venv's Triton, bf16 at d = 72 (writes -quick files)", device=False)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--versions", nargs="+", help="Triton versions (default: the pinned ones and the venv's)")
    parser.add_argument("--all-switches", action="store_true", help="all 16 switch combinations, not the released")
    parser.add_argument("--install", action="store_true", help="install the missing Triton versions and stop")
    parser.add_argument("--recorded-only", action="store_true", help="write the results and table, compile nothing")
    args = parser.parse_args(argv)
    versions = args.versions or ([venv_version()] if args.quick else [*PINNED, venv_version()])
    if args.install:
        install(versions)
        return
    if args.quick:
        args.targets = ["sm_90"]
    absent = missing_versions(versions)
    if absent:
        parser.error(f"Triton {', '.join(absent)} not installed in {VERSIONS_DIR}: run with --install first")
    discovery = discover(args.all_switches)
    if args.quick:
        discovery["specs"] = [s for s in discovery["specs"] if any(c[:2] == ["bf16", 72] for c in s["cases"])]
    stem = f"{STEM}-quick" if args.quick else STEM
    rows = recorded_rows(args.out / f"{STEM}.json")
    jobs = plan(discovery, args.targets, versions)

    def write() -> None:
        results = results_document(discovery, jobs, rows, versions)
        save_results(args.out, stem, results, markdown(results), plot)
        if not args.quick:
            write_table(exclusion_table(discovery, jobs, rows))

    for target, version in [] if args.recorded_only else block_order(args.targets, versions):
        compile_jobs([job for job in jobs if job["target"] == target and job["version"] == version], version, rows)
        write()  # after each block: a run stopped later keeps what it compiled in the results too
        done, planned = coverage(jobs, rows)[target][version]
        print(f"{target} Triton {version}: {done} of {planned} rows", flush=True)
    if args.recorded_only:
        write()


if __name__ == "__main__":
    main()
