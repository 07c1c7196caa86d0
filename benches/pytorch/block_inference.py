"""PyTorch's side of `nnfuse demo --inference`: the same bottleneck block forward-only
(ResNet-50's conv2_x with an identity shortcut, 256->64->256 channels at 56x56: conv 1x1,
BN, ReLU, conv 3x3, BN, ReLU, conv 1x1, BN, + input, ReLU), eager inference under
torch.no_grad() with the BatchNorms in eval mode (running statistics), no convolution biases,
measured the way the demo measures nnfuse's GPU time:

- GPU us per block: CUDA events around one block queued behind a head start of GPU work (fills
  of a 2 GiB buffer covering twice the host's queueing time plus 0.5 ms), median over
  --samples blocks, after warm-up calls (cudnn.benchmark's search happens there);
- host us per block: wall time of queuing one block right after a synchronize, median.

Also, as a second row, PyTorch's own folded form (torch.fx's conv-BN fusion: BN folded into
the convolution's weight and bias, the add and ReLU still separate), for reference.

cudnn.benchmark = True; channels_last for every dtype (NHWC, as nnfuse's f16/bf16 demo), f32
also channels-first (f32_nchw); TF32 off (nnfuse's f32 is true f32). Run with any CUDA
PyTorch:
    python3 benches/pytorch/block_inference.py [--batch 32] [--only f16_nhwc] [--json FILE]
"""
import argparse
import copy
import json
import time

import torch
import torch.nn as nn

HEAD_START_BYTES = 2 << 30
CONFIGS = {
    "f16_nhwc": (torch.float16, torch.channels_last),
    "bf16_nhwc": (torch.bfloat16, torch.channels_last),
    "f32_nhwc": (torch.float32, torch.channels_last),
    "f32_nchw": (torch.float32, torch.contiguous_format),
}
C, MID, HW = 256, 64, 56


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(C, MID, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(MID)
        self.conv2 = nn.Conv2d(MID, MID, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(MID)
        self.conv3 = nn.Conv2d(MID, C, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(C)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + x)


def randomize_stats(m, g):
    for bn in (m.bn1, m.bn2, m.bn3):
        c = bn.num_features
        bn.weight.data = torch.rand(c, generator=g) + 0.5
        bn.bias.data = torch.rand(c, generator=g) * 0.6 - 0.3
        bn.running_mean = torch.rand(c, generator=g) * 0.4 - 0.2
        bn.running_var = torch.rand(c, generator=g) * 1.5 + 0.5


def folded(block):
    """torch.fx's conv-BN folding (weights and biases), the add and ReLU unchanged."""
    from torch.fx.experimental.optimization import fuse

    return fuse(copy.deepcopy(block))


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def measure(call, head, samples):
    """(GPU us, host us) per call."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    host = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        host.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    head.zero_()
    b.record()
    b.synchronize()
    fill_us = max(a.elapsed_time(b) * 1e3, 1.0)
    fills = max(1, min(5000, int((2 * median(host) + 500) / fill_us) + 1))
    gpu = []
    for _ in range(samples):
        torch.cuda.synchronize()
        for _ in range(fills):
            head.zero_()
        a.record()
        call()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e3)
    return median(gpu), median(host)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--samples", type=int, default=50, help="GPU and host samples")
    ap.add_argument("--only", default="", help="comma-separated: " + ",".join(CONFIGS))
    ap.add_argument("--json", help="write one JSON object per line to FILE")
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    names = [n for n in a.only.split(",") if n] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--only: unknown {unknown}; known: {list(CONFIGS)}")
    out = open(a.json, "w") if a.json else None
    print(f"# nnfuse demo --inference's block in PyTorch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}, batch {a.batch}\n")
    print("| config | form | GPU us | host us |")
    print("|---|---|---|---|")
    head = torch.empty(HEAD_START_BYTES, dtype=torch.uint8, device="cuda")
    g = torch.Generator().manual_seed(1)
    for name in names:
        dtype, fmt = CONFIGS[name]
        block = Block()
        randomize_stats(block, g)
        block = block.eval()
        forms = [("eager", block), ("eager, fx conv-BN folded", folded(block))]
        x = torch.randn(a.batch, C, HW, HW, generator=g).to("cuda", dtype).contiguous(
            memory_format=fmt)
        for form, m in forms:
            m = m.to("cuda", dtype).to(memory_format=fmt).eval()

            def call(m=m):
                with torch.no_grad():
                    return m(x)

            gpu, host = measure(call, head, a.samples)
            print(f"| {name} | {form} | {gpu:.1f} | {host:.1f} |", flush=True)
            if out:
                out.write(json.dumps(dict(impl="pytorch", config=name, form=form, batch=a.batch,
                                          gpu_us=gpu, host_us=host, samples=a.samples)) + "\n")
        del forms, block, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
