"""PyTorch's side of the BatchNorm inference comparison in benches/batchnorm.rs.

Times, on the GPU PyTorch sees, F.batch_norm(training=False) followed by an in-place ReLU, and a
device-to-device tensor copy of the same bytes, at 64x256x56x56 in f16 and f32, channels-first
and channels-last: CUDA events around each call, 5 warm-up calls, median of 50, three rotating
buffers. Run with any PyTorch that has CUDA: `python3 benches/pytorch/bn_inference.py`.
Results: docs/PERFORMANCE.md.
"""
import torch
import torch.nn.functional as F


def median_us(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())
    for dt in (torch.float16, torch.float32):
        for channels_last in (False, True):
            xs = [torch.randn(64, 256, 56, 56, device="cuda", dtype=dt) for _ in range(3)]
            if channels_last:
                xs = [x.to(memory_format=torch.channels_last) for x in xs]
            ys = [torch.empty_like(x) for x in xs]
            rm = torch.randn(256, device="cuda")
            rv = torch.rand(256, device="cuda") + 0.5
            g = torch.randn(256, device="cuda")
            b = torch.randn(256, device="cuda")
            i = [0]

            def copy():
                i[0] += 1
                ys[i[0] % 3].copy_(xs[i[0] % 3])

            def bn_relu():
                i[0] += 1
                y = F.batch_norm(xs[i[0] % 3], rm, rv, g, b, False, 0.1, 1e-5)
                F.relu(y, inplace=True)

            nbytes = xs[0].numel() * xs[0].element_size() * 2
            c = median_us(copy)
            n = median_us(bn_relu)
            print(
                f"{dt} channels_last={channels_last}: copy {c:.1f} us "
                f"({nbytes / c / 1e6:.2f} TB/s), torch bn+relu {n:.1f} us"
            )


if __name__ == "__main__":
    main()
