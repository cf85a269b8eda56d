"""jaxkv's decode speed on two jax versions, alternating on one machine.

Runs the shared benchmark (`../shared/bench/jaxkv_vs_hf.py --with-jaxref`: jaxkv, transformers and the plain
170-line JAX decoder on the same weights, round robin) under two Python interpreters, each with its own jax,
A B A B ..., so a drift of the machine lands on both sides. Prints, per interpreter, the medians over the runs of
jaxkv's end-to-end tokens/s, the plain-JAX decoder's, and jaxkv/plain-JAX from the same run; then B/A of each.

    python scripts/compare_jax_versions.py --a /root/.pyenv/versions/3.11.7/bin/python \\
        --b /work/venv312/bin/python --model small --repeats 2

Each interpreter must have jaxkv importable (an editable install, or PYTHONPATH) and the benchmark's needs
(torch, transformers). Nothing else should run meanwhile: the benchmark waits for a quiet machine and warns
when other processes took CPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO.parent / "shared" / "bench" / "jaxkv_vs_hf.py"


def jax_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import jax, sys; print(jax.__version__, sys.version.split()[0])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def one_run(python: str, model: str, rounds: int, out: pathlib.Path) -> dict:
    cmd = [python, str(BENCH), "--model", model, "--with-jaxref", "--rounds", str(rounds),
           "--min-rounds", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if not out.exists():
        sys.exit(f"the benchmark wrote no figures ({python}, exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    res = json.loads(out.read_text())
    s = res["summary"]
    return dict(jaxkv=s["jaxkv"]["e2e_tok_s"]["median"], jaxref=s["jaxref"]["e2e_tok_s"]["median"],
                ratio=res["ratio_jaxkv_over_jaxref_e2e"]["median"],
                foreign=max(s[i]["foreign_util"]["max"] for i in s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="interpreter A (e.g. the one with jax 0.10.2)")
    ap.add_argument("--b", required=True, help="interpreter B (e.g. the one with jax 0.12.x)")
    ap.add_argument("--model", choices=("small", "medium"), default="small")
    ap.add_argument("--repeats", type=int, default=2, help="benchmark runs per interpreter, alternating")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds inside each benchmark run")
    args = ap.parse_args()
    if not BENCH.exists():
        sys.exit(f"the shared benchmark is not at {BENCH}")
    sides = {"A": args.a, "B": args.b}
    versions = {k: jax_version(p) for k, p in sides.items()}
    runs = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for k, python in sides.items():
                r = one_run(python, args.model, args.rounds, pathlib.Path(tmp) / f"{k}{i}.json")
                runs[k].append(r)
                print(f"run {i} {k} (jax, Python {versions[k]}): jaxkv {r['jaxkv']:.1f} tok/s, plain JAX "
                      f"{r['jaxref']:.1f}, jaxkv/plain {r['ratio']:.3f}, other processes up to "
                      f"{r['foreign']:.2f} cores", flush=True)
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("jaxkv", "jaxref", "ratio")}
           for k, rs in runs.items()}
    print(f"\n{args.model}, batch 1, medians over {args.repeats} runs per side:")
    for k in sides:
        print(f"  {k} (jax, Python {versions[k]}): jaxkv {med[k]['jaxkv']:.1f} tok/s, plain JAX "
              f"{med[k]['jaxref']:.1f} tok/s, jaxkv/plain {med[k]['ratio']:.3f}")
    print(f"  B/A: jaxkv {med['B']['jaxkv'] / med['A']['jaxkv']:.3f}, plain JAX "
          f"{med['B']['jaxref'] / med['A']['jaxref']:.3f}")


if __name__ == "__main__":
    main()
