"""PyTorch's host time per cached call, measured the way benches/host_overhead.rs measures
nnfuse's: rounds of CALLS calls queued without synchronising inside a round (the GPU keeps up:
the problems are tiny), after warm-up; the median over rounds of the wall time per call.

Cases (the same problems as the Rust bench's rows):
- F.conv2d 1x16x8x8, 3x3, 16 filters, f16 channels_last (cudnn.benchmark, cached);
- torch.matmul 64x64x64 f16;
- torch.relu 4096 f16 (out of place);
- BatchNorm training forward + backward 2x8x8x64 f16 channels_last (F.batch_norm with
  running statistics, then torch.autograd.grad with a given dy).

    python3 benches/pytorch/host_overhead.py [--json FILE]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

CALLS = 100
ROUNDS = 7


def host_us(fn):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t) * 1e6 / CALLS)
        torch.cuda.synchronize()
    return statistics.median(per)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write one JSON object per line to FILE")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    h = torch.float16
    rows = []

    x = torch.randn(1, 16, 8, 8, device=dev, dtype=h).to(memory_format=torch.channels_last)
    w = torch.randn(16, 16, 3, 3, device=dev, dtype=h).to(memory_format=torch.channels_last)
    rows.append(("F.conv2d 1x16x8x8 3x3 f16 channels_last", host_us(lambda: F.conv2d(x, w, padding=1))))

    a = torch.randn(64, 64, device=dev, dtype=h)
    b = torch.randn(64, 64, device=dev, dtype=h)
    rows.append(("torch.matmul 64x64x64 f16", host_us(lambda: torch.matmul(a, b))))

    r = torch.randn(4096, device=dev, dtype=h)
    rows.append(("torch.relu 4096 f16", host_us(lambda: torch.relu(r))))

    xb = torch.randn(2, 64, 8, 8, device=dev, dtype=h).to(memory_format=torch.channels_last)
    xb.requires_grad_(True)
    g = torch.ones(64, device=dev, dtype=torch.float32, requires_grad=True)
    bb = torch.zeros(64, device=dev, dtype=torch.float32, requires_grad=True)
    rm = torch.zeros(64, device=dev)
    rv = torch.ones(64, device=dev)
    dy = torch.randn_like(xb)

    def bn_step():
        y = F.batch_norm(xb, rm, rv, g, bb, training=True, momentum=0.1, eps=1e-5)
        torch.autograd.grad(y, (xb, g, bb), dy)

    rows.append(("BatchNorm train fwd+bwd 2x8x8x64 f16 channels_last", host_us(bn_step)))

    print(f"# PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}: host µs per cached call ({CALLS} calls a round, "
          f"median of {ROUNDS} rounds)\n")
    print("| case | host µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            for name, us in rows:
                f.write(json.dumps({"bench": "pytorch_host_overhead", "case": name,
                                    "host_us": us}) + "\n")


if __name__ == "__main__":
    main()
