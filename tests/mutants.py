"""Mutation check: break one invariant at a time and show the suite going red.

    .venv/bin/python tests/mutants.py                  # all mutants
    .venv/bin/python tests/mutants.py 0 3              # by index in the whole list
    .venv/bin/python tests/mutants.py --area engine    # those of tests/mutations/engine.toml
    .venv/bin/python tests/mutants.py -k "decode share"  # those whose name holds the words

The mutants are data, beside the tests of what they mutate: tests/mutations/<area>.toml, one file
per package of the tree (engine, router, operator, kernels, ...), each entry a `[[mutant]]` with
the rule it breaks (`name`), the `file`, the snippet to `find` and what to `replace` it with, and
the `tests` (pytest arguments) that must then fail. Each mutant replaces the first occurrence of
its snippet in a temporary copy of the tree (the files git tracks, and the untracked ones it does
not ignore) and runs its tests there: the checkout is never written, so a run killed midway leaves
nothing behind. The copy is imported through PYTHONPATH (which every stage process the tests start
inherits), ahead of the venv's editable install. A mutant reported GREEN is a hole in the tests.
A mutant whose tests are still running after `--limit-s` (900 s) is killed with them and counted
RED, as mutation testing counts a timeout: the suite would hang on it too.
Exit status is the number of GREEN mutants. tests/test_mutants_current.py checks that every
snippet is still in its file.
"""

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib

MUTATIONS = pathlib.Path(__file__).resolve().parent / "mutations"


def load(area: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """(name, file, find, replace, tests) of every mutant, area files in name order."""
    out = []
    for path in sorted(MUTATIONS.glob("*.toml")):
        if area is not None and path.stem != area:
            continue
        for m in tomllib.loads(path.read_text())["mutant"]:
            out.append((m["name"], m["file"], m["find"], m["replace"], m["tests"]))
    return out


MUTANTS = load()

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
# Import name -> its folder in the tree (pyproject.toml's package-dir).
PACKAGES = {
    "pipeserve": "services/pipeserve",
    "pipeserve_kernels": "kernels/pipeserve_kernels",
    "pipeserve_operator": "operator/pipeserve_operator",
}


def copy_tree(dest: pathlib.Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in listed)):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_mutant(
    path: str, old: str, new: str, tests: str, limit_s: float = 900
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="pipeserve-mutant-") as tmp:
        tree, imports = pathlib.Path(tmp) / "tree", pathlib.Path(tmp) / "imports"
        copy_tree(tree)
        imports.mkdir()
        for name, folder in PACKAGES.items():
            (imports / name).symlink_to(tree / folder)
        target = tree / path
        src = target.read_text()
        assert old in src, (path, old)
        target.write_text(src.replace(old, new, 1))
        proc = subprocess.Popen(
            f"{PYTHON} -m pytest -q -x -p no:cacheprovider {tests}",
            shell=True,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(imports)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a hung run is killed with its children
        )
        try:
            out, err = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            # A hang is a failure the suite would show too (CI stops at its limit): killed, it is RED.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)  # its pipes may stay open in a child that left the group: not read
            return subprocess.CompletedProcess(proc.args, -9, f"hung: killed after {limit_s:g} s", "")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("index", nargs="*", type=int, help="indices in the whole list (default: all)")
    ap.add_argument("--area", help="only the mutants of tests/mutations/AREA.toml")
    ap.add_argument("-k", dest="words", help="only the mutants whose name holds these words")
    ap.add_argument("--limit-s", type=float, default=900, help="a mutant's tests still running then: RED")
    args = ap.parse_args()
    chosen = load(args.area)
    if args.index:
        chosen = [MUTANTS[i] for i in args.index]
    if args.words:
        chosen = [m for m in chosen if args.words.lower() in m[0].lower()]
    green = 0
    for name, path, old, new, tests in chosen:
        r = run_mutant(path, old, new, tests, args.limit_s)
        last = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
        print(f"{'RED  ' if r.returncode else 'GREEN'} {name}: {last}", flush=True)
        green += r.returncode == 0
    sys.exit(green)
