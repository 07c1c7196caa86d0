"""Tuning probe for nnfuse's f32 3x3 filter-gradient kernel (kernels/conv_wgrad.cu): compiles
the file with NVRTC under several `-D` variants (WG_KPT filters per thread, WG_DY_ONCE, WG_MINB),
launches its main kernel through the driver API on PyTorch's tensors, and prints each variant's
median time (CUDA events, 20 launches back to back, median of 7) next to cuDNN's true-f32 filter
gradient (PyTorch, TF32 off, cudnn.benchmark) and the FMA floor, with the relative L2 error of
the summed partials against a float64 filter gradient. First it times cuDNN's true-f32 filter
gradient on the 64-channel layer cut into tiles (the shapes the `cudnn_tiled` path runs).

  python3 benches/pytorch/wgrad_kernel_probe.py [variant ...]   e.g. "WG_KPT=8 WG_DY_ONCE=1"
"""
import ctypes
import glob
import math
import os
import sys

import torch

torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
torch.zeros(1, device=dev)  # the primary context, current on this thread

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEAK_F32 = 66.9e12


def load(names):
    cands = []
    for n in names:
        cands.append(n)
        site = os.path.dirname(os.path.dirname(torch.__file__))
        cands += glob.glob(os.path.join(site, "nvidia", "**", n), recursive=True)
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError:
            pass
    raise SystemExit(f"cannot load any of {names}")


nvrtc = load(["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"])
cu = load(["libcuda.so.1"])


def check(r, what):
    if r != 0:
        raise SystemExit(f"{what} failed: {r}")


def compile_variant(defines):
    src = open(os.path.join(ROOT, "kernels/prelude.cuh")).read()
    src += '\n#line 1 "conv_wgrad.cu"\n' + open(os.path.join(ROOT, "kernels/conv_wgrad.cu")).read()
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"conv_wgrad.cu", 0, None, None),
          "nvrtcCreateProgram")
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17"] + [f"-D{d}".encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    if r != 0:
        n = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise SystemExit(log.value.decode())
    n = ctypes.c_size_t()
    check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "nvrtcGetCUBINSize")
    cubin = ctypes.create_string_buffer(n.value)
    check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    mod = ctypes.c_void_p()
    check(cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    return mod


class Geom(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint32) for f in ("n", "c", "h", "w", "k", "oh", "ow")] + [
        ("ph", ctypes.c_int32), ("pw", ctypes.c_int32)] + [
        (f, ctypes.c_uint32) for f in ("segs", "units", "splits")]


def run_variant(defines, n, c, k, hw, x, dy, ref):
    d = dict(v.split("=") for v in defines)
    kpt = int(d.get("WG_KPT", 4))
    kt, ct, seg = kpt * 8, 32, 64
    segs = math.ceil(hw / seg)
    units = n * hw * segs
    tiles = math.ceil(c / ct) * math.ceil(k / kt)
    splits = max(1, min(math.ceil(264 / tiles), units))
    smem = 2 * (kt * (seg + 4) + ct * 3 * (seg + 3)) * 4
    mod = compile_variant(defines)
    f = ctypes.c_void_p()
    check(cu.cuModuleGetFunction(ctypes.byref(f), mod, b"conv_wgrad3x3_nchw_f32"), "cuModuleGetFunction")
    check(cu.cuFuncSetAttribute(f, 8, smem), "cuFuncSetAttribute")
    part = torch.full((splits, k, c, 9), float("nan"), device=dev)
    g = Geom(n, c, hw, hw, k, hw, hw, 1, 1, segs, units, splits)
    ptrs = [ctypes.c_uint64(t.data_ptr()) for t in (x, dy, part)]
    params = (ctypes.c_void_p * 4)(*[ctypes.addressof(p) for p in ptrs], ctypes.addressof(g))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    grid = (splits, math.ceil(c / ct), math.ceil(k / kt))

    def launch():
        check(cu.cuLaunchKernel(f, *grid, 256, 1, 1, smem, stream, params, None), "cuLaunchKernel")

    launch()
    torch.cuda.synchronize()
    got = part.sum(0).double()
    err = ((got - ref).norm() / ref.norm()).item()
    t = median_us(launch)
    return t, err, splits


def median_us(fn, reps=20, rounds=7):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0 / reps)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    variants = [v.split() for v in sys.argv[1:]] or [
        [], ["WG_DY_ONCE=1"], ["WG_KPT=8"], ["WG_KPT=8", "WG_DY_ONCE=1", "WG_MINB=1"]]
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
    for (n, c, k, hw, hin, pad) in [(128, 64, 64, 28, 30, 0), (512, 64, 64, 14, 16, 0),
                                    (32, 64, 64, 28, 28, 1), (128, 64, 64, 28, 28, 1)]:
        g = torch.Generator(device=dev).manual_seed(3)
        x = torch.rand(n, c, hin, hin, device=dev, generator=g) * 2 - 1
        dy = torch.rand(n, k, hw, hw, device=dev, generator=g) * 2 - 1
        t = median_us(lambda: torch.nn.grad.conv2d_weight(x, [k, c, 3, 3], dy, padding=pad))
        xl = x.to(memory_format=torch.channels_last)
        dyl = dy.to(memory_format=torch.channels_last)
        tl = median_us(lambda: torch.nn.grad.conv2d_weight(xl, [k, c, 3, 3], dyl, padding=pad))
        print(f"cuDNN true-f32 wgrad N{n} C{c} K{k} in {hin} out {hw} pad {pad}: NCHW {t:.1f} us, "
              f"NHWC {tl:.1f} us (floor {2*n*c*k*9*hw*hw/PEAK_F32*1e6:.1f})")
    for (n, c, k, hw) in [(32, 64, 64, 56), (32, 128, 128, 28)]:
        g = torch.Generator(device=dev).manual_seed(3)
        x = torch.rand(n, c, hw, hw, device=dev, generator=g) * 2 - 1
        dy = torch.rand(n, k, hw, hw, device=dev, generator=g) * 2 - 1
        ref = torch.nn.grad.conv2d_weight(x.double(), [k, c, 3, 3], dy.double(), padding=1)
        ref = ref.permute(0, 1, 2, 3).reshape(k, c, 9)
        t_cudnn = median_us(lambda: torch.nn.grad.conv2d_weight(x, [k, c, 3, 3], dy, padding=1))
        floor = 2 * n * c * k * 9 * hw * hw / PEAK_F32 * 1e6
        print(f"N{n} C{c} K{k} {hw}x{hw}: cuDNN true f32 {t_cudnn:.1f} us, FMA floor {floor:.1f} us")
        for v in variants:
            t, err, splits = run_variant(v, n, c, k, hw, x, dy, ref)
            print(f"  {' '.join(v) or 'default':40s} {t:7.1f} us ({floor / t * 100:4.1f}% of peak, "
                  f"{t_cudnn / t:.2f}x cuDNN) splits {splits} err {err:.1e}")


main()
