"""PyTorch's side of the convolution suite (benches/conv_suite.rs): every problem of
benches/conv_problems.txt, forward (F.conv2d), data gradient and filter gradient
(aten.convolution_backward with one output each, as autograd calls it), measured the way the
Rust bench measures nnfuse:

- first call: wall time of the problem's first call up to a synchronize (cudnn.benchmark's
  autotuning included);
- GPU µs per call: CUDA events around bursts of K calls queued behind a head start of GPU work
  (memsets of a 2 GiB buffer), median over 15 samples of the per-call mean;
- host µs per call: wall time of queuing those bursts, per call.

cudnn.benchmark = True; f16/bf16 problems are channels_last, f32 problems channels-first with
TF32 off (nnfuse's f32 convolutions are true f32). Run with any CUDA PyTorch:
    python3 benches/pytorch/conv_suite.py [--filter NAME] [--json FILE]
Then benches/pytorch/compare_conv.py joins this JSON with the Rust bench's.
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

HEAD_START_BYTES = 2 << 30
SAMPLES = 15
PROBLEMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conv_problems.txt")
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def problems():
    for line in open(PROBLEMS):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        f = line.split()
        name, n, c, h, w, k, kh, kw, s, ph, pw, d, dt = f
        yield dict(name=name, n=int(n), c=int(c), h=int(h), w=int(w), k=int(k), kh=int(kh),
                   kw=int(kw), stride=int(s), pad=(int(ph), int(pw)), dil=int(d), dtype=dt)


def measure(call, head):
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    for _ in range(3):
        call()
    host_est_us = (time.perf_counter() - t) * 1e6 / 3
    torch.cuda.synchronize()
    k = max(1, min(20, int(400.0 / max(host_est_us, 1.0))))
    memsets = max(1, -(-int(host_est_us * k) // 400))
    gpu, host = [], []
    for _ in range(SAMPLES):
        for _ in range(memsets):
            head.zero_()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        for _ in range(k):
            call()
        host.append((time.perf_counter() - t) * 1e6 / k)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e3 / k)
    gpu.sort()
    host.sort()
    return first_ms, gpu[len(gpu) // 2], host[len(host) // 2]


def run(p, head):
    dt = DTYPES[p["dtype"]]
    fmt = torch.channels_last if p["dtype"] != "f32" else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.rand(p["n"], p["c"], p["h"], p["w"], device="cuda", generator=g) * 2 - 1).to(dt)
    w = (torch.rand(p["k"], p["c"], p["kh"], p["kw"], device="cuda", generator=g) * 2 - 1).to(dt)
    x = x.contiguous(memory_format=fmt)
    w = w.contiguous(memory_format=fmt)
    stride, pad, dil = (p["stride"],) * 2, p["pad"], (p["dil"],) * 2
    with torch.no_grad():
        y = F.conv2d(x, w, None, stride, pad, dil)
    dy = (torch.rand(y.shape, device="cuda", generator=g) * 2 - 1).to(dt).contiguous(memory_format=fmt)
    bw = torch.ops.aten.convolution_backward

    def fwd():
        with torch.no_grad():
            F.conv2d(x, w, None, stride, pad, dil)

    def dgrad():
        bw(dy, x, w, None, stride, pad, dil, False, [0, 0], 1, [True, False, False])

    def wgrad():
        bw(dy, x, w, None, stride, pad, dil, False, [0, 0], 1, [False, True, False])

    return [(name, measure(f, head)) for name, f in (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", default="")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    out = open(a.json, "w") if a.json else None
    print(f"# Convolution suite: PyTorch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}\n")
    print("| problem | type | dir | first call ms | GPU µs | host µs |")
    print("|---|---|---|---|---|---|")
    head = torch.empty(HEAD_START_BYTES, dtype=torch.uint8, device="cuda")
    for p in problems():
        if a.filter not in p["name"]:
            continue
        for d, (first_ms, gpu_us, host_us) in run(p, head):
            print(f"| {p['name']} | {p['dtype']} | {d} | {first_ms:.1f} | {gpu_us:.1f} | {host_us:.1f} |",
                  flush=True)
            if out:
                out.write(json.dumps(dict(impl="pytorch", problem=p["name"], dtype=p["dtype"], dir=d,
                                          first_ms=first_ms, gpu_us=gpu_us, host_us=host_us)) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
