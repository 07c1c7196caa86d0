#!/usr/bin/env python3
"""GEMM formulations of an f32 NCHW pointwise (1x1) convolution, timed on the GPU with PyTorch.

Why: `nnfuse demo --dtype f32 --format nchw` spends 206-222 us in each 1x1 filter gradient
(3.29 GFLOP, 15 TFLOP/s) where its forward and data gradients of the same size take 90-126 us.
nnfuse's im2col route permutes x and dy into one GEMM of k = n*P; cuDNN is no faster. This
probe times, with cuBLAS through PyTorch (TF32 off, so plain FP32 as nnfuse's f32 routes):
  * cuDNN's filter gradient (aten.convolution_backward),
  * the per-image batched GEMM (batch n, k = P) plus the sum over images: no copy at all,
  * the same GEMMs split further along P (batch n*s, k = P/s; the copy that makes the split
    uniform is excluded: a pointer-array batched GEMM needs no copy),
  * the permuted single GEMM (nnfuse's route today), copies timed separately,
  * the forward and data gradient as a batched GEMM with the filter broadcast.
Each row: median GPU time of 50 runs after 10 warm-up runs (CUDA events), TFLOP/s, and the
FLOP floor at the H100's 67 TFLOP/s FP32 peak.

    python3 benches/pytorch/f32_pointwise_gemm.py [--n 32] [--hw 56]
"""
import argparse

import torch

PEAK = 66.9e12  # H100 SXM FP32 (non-tensor) FLOP/s


def timed(fn, reps=50, warm=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def row(name, us, flops):
    print(f"  {name:58s} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  floor {flops / PEAK * 1e6:6.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--hw", type=int, default=56)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    n, hw = args.n, args.hw
    P = hw * hw
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"f32 NCHW 1x1, batch {n}, {hw}x{hw} (P = {P}), TF32 off")
    for cin, cout in ((256, 64), (64, 256)):
        flops = 2.0 * n * P * cin * cout
        x = torch.randn(n, cin, hw, hw, device=dev)
        w = torch.randn(cout, cin, 1, 1, device=dev)
        dy = torch.randn(n, cout, hw, hw, device=dev)
        print(f"{cin}->{cout} ({flops / 1e9:.2f} GFLOP)")
        # cuDNN
        row("cuDNN forward", timed(lambda: torch.nn.functional.conv2d(x, w)), flops)
        row("cuDNN data gradient",
            timed(lambda: torch.ops.aten.convolution_backward(
                dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, False, False])), flops)
        row("cuDNN filter gradient",
            timed(lambda: torch.ops.aten.convolution_backward(
                dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])), flops)
        xv, dyv, wm = x.view(n, cin, P), dy.view(n, cout, P), w.view(cout, cin)
        # forward / data gradient: filter broadcast over the batch
        row("bmm forward y[n] = w x[n]", timed(lambda: torch.matmul(wm, xv)), flops)
        row("bmm data gradient dx[n] = w^T dy[n]", timed(lambda: torch.matmul(wm.t(), dyv)), flops)
        # filter gradient, per image then summed
        part = torch.empty(n, cout, cin, device=dev)
        row("bmm per image dw[n] = dy[n] x[n]^T (k = P)",
            timed(lambda: torch.bmm(dyv, xv.transpose(1, 2), out=part)), flops)
        part2 = torch.empty(n, cin, cout, device=dev)
        row("bmm per image, other order dw[n]^T = x[n] dy[n]^T",
            timed(lambda: torch.bmm(xv, dyv.transpose(1, 2), out=part2)), flops)
        row("  sum of the n partials", timed(lambda: part.sum(0)), 0.0 + 1e-9)
        for s in (2, 4, 7, 14):
            if P % s:
                continue
            L = P // s
            xs = xv.view(n, cin, s, L).permute(0, 2, 1, 3).reshape(n * s, cin, L)
            dys = dyv.view(n, cout, s, L).permute(0, 2, 1, 3).reshape(n * s, cout, L)
            ps = torch.empty(n * s, cout, cin, device=dev)
            row(f"bmm split s={s}: batch {n * s}, k = {L} (copies excluded)",
                timed(lambda: torch.bmm(dys, xs.transpose(1, 2), out=ps)), flops)
            ps2 = torch.empty(n * s, cin, cout, device=dev)
            row(f"bmm split s={s}, other order",
                timed(lambda: torch.bmm(xs, dys.transpose(1, 2), out=ps2)), flops)
        # the permuted single GEMM (k = n*P)
        xp = x.view(n, cin, P).permute(1, 0, 2).reshape(cin, n * P)
        dyp = dy.view(n, cout, P).permute(1, 0, 2).reshape(cout, n * P)
        row("one GEMM over k = n*P (permuted copies excluded)", timed(lambda: dyp @ xp.t()), flops)
        row("  the permuted copies of x and dy",
            timed(lambda: (x.view(n, cin, P).permute(1, 0, 2).contiguous(),
                           dy.view(n, cout, P).permute(1, 0, 2).contiguous())), 1e-9)
        # accuracy of the per-image formulation against f64
        ref = torch.einsum("ncp,nkp->kc", xv.double(), dyv.double())
        got = torch.bmm(dyv, xv.transpose(1, 2)).sum(0).double()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"  per-image + sum vs f64: relative L2 error {err:.2e}")


if __name__ == "__main__":
    main()
