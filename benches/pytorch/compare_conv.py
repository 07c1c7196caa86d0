"""Joins the convolution suite's two JSON files (benches/conv_suite.rs --json A,
benches/pytorch/conv_suite.py --json B) and prints, per problem-direction, nnfuse's GPU time
against PyTorch's (ratio > 1: nnfuse faster), host times and first-call times, then the
geometric mean, the worst ratio, the count below 0.95 and the first-call percentiles.
    python3 benches/pytorch/compare_conv.py NNFUSE.json PYTORCH.json
"""
import json
import math
import sys


def load(path):
    rows = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[(r["problem"], r["dir"])] = r
    return rows


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(math.ceil(q * len(v))) - 1)] if v else float("nan")


def main():
    nn, pt = load(sys.argv[1]), load(sys.argv[2])
    keys = [k for k in nn if k in pt]
    print("| problem | type | dir | nnfuse route | nnfuse GPU µs | PyTorch GPU µs | speed-up | "
          "host µs nnfuse / PyTorch | first ms nnfuse / PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios, firsts = [], []
    for k in keys:
        a, b = nn[k], pt[k]
        r = b["gpu_us"] / a["gpu_us"]
        ratios.append(r)
        firsts.append(a["first_ms"])
        print(f"| {k[0]} | {a['dtype']} | {k[1]} | {a['route']} | {a['gpu_us']:.1f} | {b['gpu_us']:.1f} | "
              f"{r:.2f}x | {a['host_us']:.1f} / {b['host_us']:.1f} | {a['first_ms']:.0f} / {b['first_ms']:.0f} |")
    if not ratios:
        print("no common rows")
        return
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    worst = min(zip(ratios, keys))
    print(f"\n{len(ratios)} problem-directions: geometric mean {gm:.3f}x PyTorch, worst {worst[0]:.2f}x "
          f"({worst[1][0]} {worst[1][1]}), {sum(r < 0.95 for r in ratios)} below 0.95x, "
          f"{sum(r < 0.9 for r in ratios)} below 0.90x")
    print(f"nnfuse first call (one direction): median {pct(firsts, 0.5):.0f} ms, p95 {pct(firsts, 0.95):.0f} ms, "
          f"max {max(firsts):.0f} ms")


if __name__ == "__main__":
    main()
