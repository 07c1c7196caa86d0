"""Which kernels PyTorch (cudnn.benchmark, channels_last) runs for ResNet-50's 7x7/2 stem filter
gradient in f16 (N 32, C 3, 224x224, K 64), and their GPU time: the one conv-suite row where
nnfuse's `auto` reads below 0.95x of PyTorch. The kernel names say the accumulation type
(cuDNN's `f16f16_f16f32` style: inputs, output, accumulator), which tells whether PyTorch runs
an engine that nnfuse's numerical-note filter passes over ("accumulates below f32").

  python3 benches/pytorch/stem_wgrad_kernels.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

torch.backends.cudnn.benchmark = True
dev = "cuda"
x = torch.randn(32, 3, 224, 224, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)
dy = torch.randn(32, 64, 112, 112, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)


def wgrad():
    return torch.nn.grad.conv2d_weight(x, [64, 3, 7, 7], dy, stride=2, padding=3)


for _ in range(5):
    wgrad()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        wgrad()
    torch.cuda.synchronize()
print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
for e in prof.key_averages():
    if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0) > 0:
        print(f"{e.count:4d} x {e.device_time_total / max(e.count, 1):9.1f} us  {e.key}")
