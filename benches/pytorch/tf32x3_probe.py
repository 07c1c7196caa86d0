"""Probe: can three-pass TF32 ("3xTF32": x = hi + lo with hi rounded to TF32) convolutions
beat cuDNN's true-f32 engines on the demo's f32 NCHW layers, at f32 accuracy?

Each operand is split into hi (TF32-exact) and lo = x - hi (exact in f32). A convolution is
linear in its reduction channels, so the three products hi*hi + hi*lo + lo*hi become ONE
TF32 convolution on channel-concatenated operands:
  forward  y  = conv([x_hi|x_lo|x_hi], [w_hi|w_hi|w_lo])        (3C reduction channels)
  dgrad    dx = dgrad([dy_hi|dy_lo|dy_hi], [w_hi;w_hi;w_lo])     (3K reduction channels)
  wgrad    dW2 = wgrad([x_hi|x_lo], [dy_hi|dy_lo]) (2K x 2C), dw = sum of its four blocks
Times cuDNN (cudnn.benchmark) for each with CUDA events, median of 30 after warm-up; the
split is one pass over the operands (not timed here: bytes over bandwidth are printed).
Accuracy against a float64 convolution: rel_l2 = ||got - ref|| / ||ref|| (the demo's rule).
"""
import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = True
dev = "cuda"
BW = 3.35e12  # H100 SXM HBM3 bytes/s


def tf32_split(t):
    bits = t.contiguous().view(torch.int32)
    hi = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return hi, t - hi


def timeit(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0)
    ts.sort()
    return ts[len(ts) // 2]


def rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def wgrad(x, dy, wshape, pad):
    return torch.nn.grad.conv2d_weight(x, list(wshape), dy, padding=pad)


def dgrad(dy, w, xshape, pad):
    return torch.nn.grad.conv2d_input(list(xshape), w, dy, padding=pad)


def case(name, n, c, k, hw, r):
    pad = r // 2
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.rand(n, c, hw, hw, device=dev, generator=g) * 2 - 1
    w = (torch.rand(k, c, r, r, device=dev, generator=g) * 2 - 1) / (c * r * r) ** 0.5
    dy = torch.rand(n, k, hw, hw, device=dev, generator=g) * 2 - 1
    xd, wd, dyd = x.double(), w.double(), dy.double()
    xh, xl = tf32_split(x)
    wh, wl = tf32_split(w)
    dyh, dyl = tf32_split(dy)
    rows = []
    act = n * c * hw * hw * 4
    out = n * k * hw * hw * 4

    # forward
    ref = F.conv2d(xd, wd, padding=pad)
    torch.backends.cudnn.allow_tf32 = False
    t_f32 = timeit(lambda: F.conv2d(x, w, padding=pad))
    e_f32 = rel(F.conv2d(x, w, padding=pad), ref)
    torch.backends.cudnn.allow_tf32 = True
    x3 = torch.cat([xh, xl, xh], 1).contiguous()
    w3 = torch.cat([wh, wh, wl], 1).contiguous()
    t_3 = timeit(lambda: F.conv2d(x3, w3, padding=pad))
    e_3 = rel(F.conv2d(x3, w3, padding=pad), ref)
    t_1 = timeit(lambda: F.conv2d(x, w, padding=pad))
    e_1 = rel(F.conv2d(x, w, padding=pad), ref)
    rows.append(("fwd", t_f32, e_f32, t_3, e_3, t_1, e_1, (act + 3 * act) / BW * 1e6))

    # data gradient
    ref = dgrad(dyd, wd, xd.shape, pad)
    torch.backends.cudnn.allow_tf32 = False
    t_f32 = timeit(lambda: dgrad(dy, w, x.shape, pad))
    e_f32 = rel(dgrad(dy, w, x.shape, pad), ref)
    torch.backends.cudnn.allow_tf32 = True
    dy3 = torch.cat([dyh, dyl, dyh], 1).contiguous()
    w3d = torch.cat([wh, wh, wl], 0).contiguous()
    t_3 = timeit(lambda: dgrad(dy3, w3d, x.shape, pad))
    e_3 = rel(dgrad(dy3, w3d, x.shape, pad), ref)
    t_1 = timeit(lambda: dgrad(dy, w, x.shape, pad))
    e_1 = rel(dgrad(dy, w, x.shape, pad), ref)
    rows.append(("dgrad", t_f32, e_f32, t_3, e_3, t_1, e_1, (out + 3 * out) / BW * 1e6))

    # filter gradient
    ref = wgrad(xd, dyd, w.shape, pad)
    torch.backends.cudnn.allow_tf32 = False
    t_f32 = timeit(lambda: wgrad(x, dy, w.shape, pad))
    e_f32 = rel(wgrad(x, dy, w.shape, pad), ref)
    torch.backends.cudnn.allow_tf32 = True
    x2 = torch.cat([xh, xl], 1).contiguous()
    dy2 = torch.cat([dyh, dyl], 1).contiguous()
    w2shape = (2 * k, 2 * c, r, r)

    def four():
        d = wgrad(x2, dy2, w2shape, pad)
        return d[:k, :c] + d[:k, c:] + d[k:, :c] + d[k:, c:]

    t_3 = timeit(lambda: wgrad(x2, dy2, w2shape, pad))
    e_3 = rel(four(), ref)
    # three calls on separate operands (hi*hi + hi*lo + lo*hi), no concatenation
    t_3b = timeit(lambda: (wgrad(xh, dyh, w.shape, pad), wgrad(xl, dyh, w.shape, pad),
                           wgrad(xh, dyl, w.shape, pad)))
    e_3b = rel(wgrad(xh, dyh, w.shape, pad) + wgrad(xl, dyh, w.shape, pad)
               + wgrad(xh, dyl, w.shape, pad), ref)
    t_1 = timeit(lambda: wgrad(x, dy, w.shape, pad))
    e_1 = rel(wgrad(x, dy, w.shape, pad), ref)
    rows.append(("wgrad", t_f32, e_f32, t_3, e_3, t_1, e_1, (act + out) * 3 / BW * 1e6))
    rows.append(("wgrad3c", t_f32, e_f32, t_3b, e_3b, t_1, e_1, (act + out) * 3 / BW * 1e6))

    for d, tf, ef, t3, e3, t1, e1, split in rows:
        print(f"{name:8s} {d:8s} true-f32 {tf:7.1f} us err {ef:.1e} | 3xTF32 {t3:7.1f} us "
              f"err {e3:.1e} (+split ~{split:5.1f} us) ratio {(t3 + split) / tf:.2f} | "
              f"TF32 {t1:7.1f} us err {e1:.1e}")


print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
case("conv1", 32, 256, 64, 56, 1)
case("conv2", 32, 64, 64, 56, 3)
case("conv3", 32, 64, 256, 56, 1)
