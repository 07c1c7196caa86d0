"""Which kernels PyTorch's cuDNN runs for chosen problems of the convolution suite, and for how
long: each direction of each problem whose name contains --filter, after cudnn.benchmark's
autotuning (its first call), 20 calls under torch.profiler; prints every CUDA kernel of those
calls with its mean time. For comparing with nnfuse's choice on rows where the two differ
(benches/conv_suite.rs prints nnfuse's engine config; `NNFUSE_SUITE_REPORTS=1` its candidates).
    python3 benches/pytorch/conv_kernels.py --filter vgg.3x3.512@28
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conv_suite  # noqa: E402  (the suite's problems and calls)

CALLS = 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", action="append", default=[])
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    # The suite's measure() is replaced by one that keeps the call: run() returns them in order.
    calls = []
    conv_suite.measure = lambda call, head: calls.append(call) or (0.0, 0.0, 0.0)
    for p in conv_suite.problems():
        if a.filter and not any(f in p["name"] for f in a.filter):
            continue
        calls.clear()
        dirs = [d for d, _ in conv_suite.run(p, None)]
        for d, call in zip(dirs, calls):
            for _ in range(3):
                call()  # autotuning, then warm
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    call()
                torch.cuda.synchronize()
            print(f"\n## {p['name']} {p['dtype']} {d}")
            for e in prof.key_averages():
                if e.device_type.name != "CUDA" or e.count < CALLS:
                    continue
                us = e.device_time_total / e.count
                print(f"  {us:8.1f} us x{e.count // CALLS}  {e.key[:160]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
