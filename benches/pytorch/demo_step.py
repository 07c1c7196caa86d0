"""PyTorch's side of `nnfuse demo`: the same training step (ResNet-50's bottleneck with an
identity shortcut, 256->64->256 channels at 56x56, plus the classifier fc 2048->1000 forward and
both gradients on its own random features), measured the three ways the demo measures nnfuse:

- GPU ms per step: CUDA events around one step queued behind a head start of GPU work (fills of
  a 2 GiB buffer covering twice the host's queueing time), median over --samples steps;
- loop ms per step: --steps steps queued back to back with no synchronisation between them, one
  synchronize at the end, wall clock / steps; median over --loops loops (one loop not counted);
- host ms per step: wall time of queuing one step right after a synchronize (the GPU idle, so
  no call waits for it), median over --samples steps;

each for the eager step and for the same step captured into a CUDA graph (torch.cuda.graph) and
replayed. The step: forward through the block (conv, BN+ReLU, conv, BN+ReLU, conv, BN, + input,
ReLU) and the classifier, then torch.autograd.grad of both outputs with random incoming
gradients for the block input, every filter, every BatchNorm scale and bias, the classifier's
features and weight (fresh gradients each step, as the demo overwrites its own; no .grad
accumulation). BatchNorm in training mode, momentum 0.1, eps 1e-5, parameters and statistics
in f32. No biases on convolutions or the classifier (as the demo).

cudnn.benchmark = True; f16/bf16 are channels_last (NHWC), f32 channels-first (NCHW) with TF32
off (nnfuse's f32 is true f32). Run with any CUDA PyTorch:
    python3 benches/pytorch/demo_step.py [--batch 32] [--only f16_nhwc] [--json FILE]
--json FILE writes one JSON object per line (configuration x eager/graph), as conv_suite.py.
"""
import argparse
import json
import time

import torch
import torch.nn as nn

HEAD_START_BYTES = 2 << 30
CONFIGS = {
    "f16_nhwc": (torch.float16, torch.channels_last),
    "bf16_nhwc": (torch.bfloat16, torch.channels_last),
    "f32_nchw": (torch.float32, torch.contiguous_format),
}
C, MID, HW, FC_IN, FC_OUT = 256, 64, 56, 2048, 1000


def uniform(shape, lo, hi, g, dtype=torch.float32):
    return (torch.rand(shape, device="cuda", generator=g) * (hi - lo) + lo).to(dtype)


class Step:
    """The demo's step on fixed inputs; `__call__` queues one step and returns its results."""

    def __init__(self, n, dtype, fmt, seed=1):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.convs = [nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
                      for cin, cout, k in ((C, MID, 1), (MID, MID, 3), (MID, C, 1))]
        self.bns = [nn.BatchNorm2d(ch, eps=1e-5, momentum=0.1) for ch in (MID, MID, C)]
        for conv in self.convs:
            conv.cuda()
            with torch.no_grad():
                conv.weight.copy_(uniform(conv.weight.shape, -1, 1, g))
            conv.to(dtype=dtype, memory_format=fmt)
        for bn in self.bns:
            bn.cuda().train()
            with torch.no_grad():
                bn.weight.copy_(uniform(bn.weight.shape, 0.5, 1.5, g))
                bn.bias.copy_(uniform(bn.bias.shape, -0.5, 0.5, g))
        self.x = uniform((n, C, HW, HW), -1, 1, g, dtype).contiguous(memory_format=fmt)
        self.x.requires_grad_(True)
        self.dout = uniform((n, C, HW, HW), -1, 1, g, dtype).contiguous(memory_format=fmt)
        self.feat = uniform((n, FC_IN), -1, 1, g, dtype).requires_grad_(True)
        self.fc_w = uniform((FC_OUT, FC_IN), -1, 1, g, dtype).requires_grad_(True)
        self.dlogits = uniform((n, FC_OUT), -1, 1, g, dtype)
        self.inputs = ([self.x] + [c.weight for c in self.convs]
                       + [p for bn in self.bns for p in (bn.weight, bn.bias)]
                       + [self.feat, self.fc_w])

    def __call__(self):
        c, b = self.convs, self.bns
        h = torch.relu(b[0](c[0](self.x)))
        h = torch.relu(b[1](c[1](h)))
        out = torch.relu(b[2](c[2](h)) + self.x)
        logits = self.feat @ self.fc_w.t()
        grads = torch.autograd.grad([out, logits], self.inputs, [self.dout, self.dlogits])
        return [out, logits] + list(grads)


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def measure(call, head, steps, loops, samples):
    """(GPU ms, loop ms, host ms) per call of `call` (one step or one replay)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    host = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    loop = []
    for k in range(loops + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
        if k > 0:
            loop.append((time.perf_counter() - t) * 1e3 / steps)
    # Head start: fills covering twice the host's queueing time, plus 0.5 ms.
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    head.zero_()
    b.record()
    b.synchronize()
    fill_ms = max(a.elapsed_time(b), 1e-3)
    fills = max(1, min(5000, int((2 * median(host) + 0.5) / fill_ms) + 1))
    gpu = []
    for _ in range(samples):
        torch.cuda.synchronize()
        for _ in range(fills):
            head.zero_()
        a.record()
        call()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    return median(gpu), median(loop), median(host)


def capture(step):
    """The step captured into a CUDA graph (warm-up on a side stream first, as PyTorch asks)
    and its static outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def bits(t):
    """`t`'s raw bits as integers (contiguous, flattened)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(-1).view(ints[t.element_size()])


def identical(a, b):
    """Whether every tensor of `a` has the same bits as its partner in `b`. Informational:
    cudnn.benchmark may pick algorithms that do not reproduce their bits run to run."""
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="steps per loop")
    ap.add_argument("--loops", type=int, default=7)
    ap.add_argument("--samples", type=int, default=20, help="GPU and host samples")
    ap.add_argument("--only", default="", help="comma-separated: " + ",".join(CONFIGS))
    ap.add_argument("--no-graph", action="store_true", help="eager only")
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
    print(f"# nnfuse demo's step in PyTorch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"batch {a.batch}\n")
    print("| config | mode | first step ms | GPU ms | loop ms | host ms | replay = eager bits |")
    print("|---|---|---|---|---|---|---|")
    head = torch.empty(HEAD_START_BYTES, dtype=torch.uint8, device="cuda")
    for name in names:
        dtype, fmt = CONFIGS[name]
        step = Step(a.batch, dtype, fmt)
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t) * 1e3
        modes = [("eager", step, None)]
        if not a.no_graph:
            graph, outs = capture(step)
            graph.replay()
            eager = step()
            torch.cuda.synchronize()
            modes.append(("graph", graph.replay, identical(outs, eager)))
        for mode, call, same in modes:
            gpu, loop, host = measure(call, head, a.steps, a.loops, a.samples)
            print(f"| {name} | {mode} | {first_ms:.1f} | {gpu:.3f} | {loop:.3f} | {host:.3f} | "
                  f"{'-' if same is None else same} |", flush=True)
            if out:
                out.write(json.dumps(dict(impl="pytorch", config=name, mode=mode, batch=a.batch,
                                          first_step_ms=first_ms, gpu_ms=gpu, loop_ms=loop,
                                          host_ms=host, steps_per_loop=a.steps, loops=a.loops,
                                          samples=a.samples, replay_bit_identical=same)) + "\n")
        del step, modes
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
