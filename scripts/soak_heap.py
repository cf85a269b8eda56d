"""Is the server's memory growth in the Python heap? `jaxkv serve` under tracemalloc, soak_serve.py's load.

    python scripts/soak_heap.py [--minutes 4]

Starts `jaxkv serve` (the bundled model, as scripts/soak_serve.py does) with tracemalloc tracing, runs
soak_serve's 12 clients for one minute (warm-up), snapshots the traced heap (SIGUSR1 to the server), runs them
for --minutes more, snapshots again; prints the traced heap and the server's RSS at both points and the largest
differences by file and by traceback. (Tracing makes the server slow: its warm-up compile takes minutes.)
"""

import argparse
import asyncio
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent


def serve(argv):  # the server process: tracemalloc on, SIGUSR1 writes a snapshot
    import gc
    import tracemalloc

    tracemalloc.start(12)
    out, count = pathlib.Path(argv[0]), [0]

    def dump(*_):
        gc.collect()
        name = out / f"snap{count[0]}.bin"
        tracemalloc.take_snapshot().dump(str(name) + ".part")
        pathlib.Path(str(name) + ".part").replace(name)  # whole when it appears: the driver waits for the name
        count[0] += 1

    signal.signal(signal.SIGUSR1, dump)
    from jaxkv.server.main import main

    sys.exit(main(argv[1:]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=4.0)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import httpx
    import soak_serve as soak
    import tracemalloc

    root = pathlib.Path(tempfile.mkdtemp(prefix="soak-heap-"))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(root), "--port", "0", "--model",
                             str(soak.model_dir(root)), "--slots", "4", "--max-len", "256", "--served-model-name",
                             "soak"], stdout=subprocess.PIPE, text=True)
    url = next(m.group(1) for line in proc.stdout if (m := re.search(r"listening on (http://\S+)", line)))

    async def load(minutes, seed):
        tally, start = soak.Tally(), time.monotonic()
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await asyncio.gather(*[soak.client(http, random.Random(seed * 100 + i), tally, start,
                                               start + 60 * minutes) for i in range(12)])
        await asyncio.sleep(5)
        return sum(tally.total.values())

    try:
        rss = []
        for k, minutes in enumerate((1.0, args.minutes)):
            done = asyncio.run(load(minutes, k))
            rss.append(soak.rss_bytes(proc.pid) / 2**20)
            proc.send_signal(signal.SIGUSR1)
            while not (root / f"snap{k}.bin").exists():
                time.sleep(1)
            print(f"after {minutes:g} min ({done} requests): RSS {rss[-1]:.1f} MiB", flush=True)
    finally:
        proc.terminate()
        proc.wait()
    a, b = (tracemalloc.Snapshot.load(str(root / f"snap{k}.bin")) for k in (0, 1))
    heap = [sum(s.size for s in snap.statistics("filename")) / 2**20 for snap in (a, b)]
    print(f"traced Python heap: {heap[0]:.2f} -> {heap[1]:.2f} MiB; RSS {rss[0]:.1f} -> {rss[1]:.1f} MiB")
    for stat in b.compare_to(a, "filename")[:10]:
        print(" ", stat)
    for stat in b.compare_to(a, "traceback")[:3]:
        print(f"  {stat.size_diff:+,} B, {stat.count_diff:+} blocks:")
        print("\n".join("    " + line for line in stat.traceback.format()[-8:]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    else:
        main()
