"""Two commits of splitserve in one run: the offline and KV-transfer benchmarks of each, alternated, as ratios.

A refactoring must not cost speed. This builds the baseline revision (default
``HEAD``) and the working tree each into a folder of their own (``pip install
--no-deps --target``, stubs generated, nothing of the machine's install
touched; each compiles its C++ kernels into a cache folder of its own, the
models shared), then runs, ``--repeats`` times and alternating baseline and
candidate so that the shared machine's drift hits both alike:

* ``benchmarks/offline_throughput.py --skip-hf`` of each tree (output tokens/s
  of ``LLM.generate`` on the seeded workload, and batch-1 ms per token), and
* ``benchmarks/kv_transfer.py`` of each tree (MB/s of each connector, and its
  ratio to the raw ceiling measured beside it),

and prints the medians of each with the candidate/baseline ratio (1.00 =
the same; throughputs above 1 are faster, latencies below 1 are faster).

Example::

    python benchmarks/compare_commits.py --baseline 8ccaba1 --repeats 3 --json compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]


def build(source: Path, target: Path) -> Path:
    """Install the tree at ``source`` (no dependencies) into ``target``; returns the folder to put on PYTHONPATH."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, stdout=subprocess.DEVNULL)
    return target


def checkout(revision: str, folder: Path) -> Path:
    """The files of ``revision`` (tracked ones only) in ``folder``."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def working_tree(folder: Path) -> Path:
    """The working tree's tracked and untracked (not ignored) files in ``folder``."""
    folder.mkdir(parents=True)
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                           capture_output=True).stdout.split(b"\0")
    listing = b"\0".join(name for name in files if name and (REPO / name.decode()).exists())
    archive = subprocess.run(["tar", "-c", "-C", str(REPO), "--null", "-T", "-"], input=listing, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def tree_cache(folder: Path) -> Path:
    """A cache folder of the tree's own, its models those of the machine's cache (a link): each tree compiles its
    own C++ kernels there. With one shared cache, the kernels built by whichever tree ran first (newer than
    both trees' sources) were loaded by both, and a change to them measured nothing."""
    from splitserve.common.model_info import cache_dir

    folder.mkdir(parents=True)
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(models, target_is_directory=True)
    return folder


def scripts_of(tree: Path, folder: Path) -> Path:
    """The tree's benchmarks/ copied into ``folder`` alone: a script run from there puts ``folder`` first on its
    path (to import ``benchmarks.*``), where no ``splitserve`` of the source tree shadows the tree's build. From
    the source tree, ``splitserve`` would be the bare source folder, whose subpackages (engine/, router/, ... at
    the repository's top) an editable install of this repository's own then supplied: the candidate's, for both."""
    shutil.copytree(tree / "benchmarks", folder / "benchmarks")
    return folder


def run_json(scripts: Path, site: Path, cache: Path, script: str, arguments: list[str], out: Path) -> dict:
    """Run ``script`` of ``scripts`` (:func:`scripts_of`) on the build in ``site``; its JSON report. Its output
    goes to a log beside ``out``, named in the error when it fails."""
    env = dict(os.environ, PYTHONPATH=str(site), SPLITSERVE_CACHE=str(cache))
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        result = subprocess.run([sys.executable, str(scripts / "benchmarks" / script), *arguments, "--json", str(out)],
                                env=env, cwd=tempfile.gettempdir(), stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode:
        raise RuntimeError(f"{script} failed (exit {result.returncode}); its last lines:\n"
                           + "".join(log.read_text().splitlines(keepends=True)[-15:]))
    with open(out) as handle:
        return json.load(handle)


def offline_figures(report: dict) -> dict[str, float]:
    system = report["systems"]["splitserve"]
    return {"offline tok/s": system["median_tokens_per_second"],
            "batch-1 ms/token": system["median_ms_per_output_token"]}


def kv_figures(report: dict) -> dict[str, float]:
    figures = {}
    for row in report["rows"]:
        name = f"{row['connector']}/{row['checksum']} {row['tokens']} tok"
        figures[f"{name} MB/s"] = row["connector_mb_per_s"]
        figures[f"{name} / ceiling"] = row["ratio"]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare against (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each benchmark per tree, alternating (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=32,
                        help="requests of the offline workload (default: %(default)s)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096],
                        help="KV transfer sizes in prompt tokens (default: %(default)s)")
    parser.add_argument("--kv-repeats", type=int, default=3,
                        help="transfers per point inside each kv_transfer run (default: %(default)s)")
    parser.add_argument("--skip-offline", action="store_true", help="KV transfer only")
    parser.add_argument("--skip-kv", action="store_true", help="offline throughput only")
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures to FILE")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="splitserve-compare-") as scratch:
        scratch = Path(scratch)
        trees = {}
        for name, materialize in (("baseline", lambda f: checkout(args.baseline, f)), ("candidate", working_tree)):
            source = materialize(scratch / f"{name}-src")
            trees[name] = (scripts_of(source, scratch / f"{name}-scripts"), build(source, scratch / f"{name}-site"),
                           tree_cache(scratch / f"{name}-cache"))
        jobs = []
        if not args.skip_offline:
            jobs.append(("offline_throughput.py", ["--skip-hf", "--repeats", "1", "--num-requests",
                                                   str(args.num_requests)], offline_figures))
        if not args.skip_kv:
            jobs.append(("kv_transfer.py", ["--repeats", str(args.kv_repeats), "--tokens", *map(str, args.tokens)],
                         kv_figures))
        runs: dict[str, list[dict[str, float]]] = {"baseline": [], "candidate": []}
        with tqdm(total=args.repeats * 2 * len(jobs), desc="benchmark runs", file=sys.stderr) as bar:
            for repeat in range(args.repeats):
                # Alternate which tree goes first, so neither always runs on a warmer machine.
                order = ["baseline", "candidate"] if repeat % 2 == 0 else ["candidate", "baseline"]
                figures = {name: {} for name in order}
                for script, arguments, extract in jobs:
                    for name in order:
                        scripts, site, cache = trees[name]
                        report = run_json(scripts, site, cache, script, arguments, scratch / f"{name}-{repeat}.json")
                        figures[name].update(extract(report))
                        bar.update()
                for name in order:
                    runs[name].append(figures[name])

    print(f"baseline {args.baseline} vs the working tree; medians of {args.repeats} alternating runs")
    print(f"{'figure':<34} {'baseline':>12} {'candidate':>12} {'ratio':>7}")
    for key in runs["baseline"][0]:
        old = statistics.median(run[key] for run in runs["baseline"])
        new = statistics.median(run[key] for run in runs["candidate"])
        print(f"{key:<34} {old:>12,.2f} {new:>12,.2f} {new / old:>7.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "runs": runs}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
