"""The prepared check for a machine with a GPU: what it has, then the ``gpu``-marked tests (tests/test_gpu.py).

    python benchmarks/gpu_check.py                # about 2 minutes on one GPU; exits 1 if a test fails
    python benchmarks/gpu_check.py --json runs/gpu_check.json

It prints torch's and CUDA's versions, the device, whether bf16 is supported and NCCL is available, then runs
``pytest -m gpu`` with a hard timeout (among them ``zbh1``, ``interleaved`` and ``zbv`` against 1F1B on CUDA, fp32 and
bf16). Without CUDA it says so and exits 2: nothing is claimed about GPUs that was
not run on one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    info: dict[str, object] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            cuda=torch.version.cuda,
            device=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            devices=torch.cuda.device_count(),
            bf16=torch.cuda.is_bf16_supported(),
            nccl=dist.is_nccl_available(),
        )
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the machine and the test outcome here")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds before the tests are stopped")
    args = parser.parse_args()
    info = machine()
    for key, value in info.items():
        print(f"{key:>15}: {value}")
    if not info["cuda_available"]:
        print("no CUDA device here: the gpu tests were not run")
        return 2
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"timed out after {args.timeout:g} s\n{err.stdout or ''}"
    seconds = time.perf_counter() - started
    print(out[-6000:])
    print(f"gpu tests: exit {code} in {seconds:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "exit": code, "seconds": seconds, "output": out[-20000:]}, indent=1))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
