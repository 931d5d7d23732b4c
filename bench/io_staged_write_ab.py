"""A/B of a staged write's tensor -> pool copy: in the engine's workers (native, the default) vs
on the event-loop thread (dsio._transfer.LOOP_THREAD_COPY), interleaved rep by rep.

    python bench/io_staged_write_ab.py [REPS=5]

512 MiB from a tensor at 64 mod 4096 (always staged), fsync'd, file recreated each rep. Prints the
GB/s per rep as JSON, then a markdown row per case with the median of per-rep ratios to loop copy.
"""

import asyncio
import json
import os
import statistics as S
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import dsio  # noqa: E402
import dsio._transfer as transfer  # noqa: E402
from bench._common import scratch_dir  # noqa: E402

size = 512 << 20
d = scratch_dir()
os.makedirs(d, exist_ok=True)
path = os.path.join(d, "wab.bin")
src = torch.ones(size + 64, dtype=torch.uint8)[64:]
assert src.data_ptr() % 4096
res = {"native": [], "loop copy": []}


async def main():
    async with dsio.AsyncIOHandle() as h:
        for _rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
            for case in ("native", "loop copy"):
                transfer.LOOP_THREAD_COPY = case == "loop copy"
                if os.path.exists(path):
                    os.unlink(path)
                t0 = time.perf_counter()
                await h.pwrite(src, path, fsync=True)
                res[case].append(size / (time.perf_counter() - t0) / 1e9)


asyncio.run(main())
os.unlink(path)
print(json.dumps(res))
for c, g in res.items():
    rat = [a / b for a, b in zip(g, res["loop copy"])]
    print(
        f"| {c} | {S.median(g):.2f} ({min(g):.2f}-{max(g):.2f}) | {S.median(rat):.2f} ({min(rat):.2f}-{max(rat):.2f}) |"
    )
