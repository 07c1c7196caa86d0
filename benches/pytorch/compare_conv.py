"""Joins the convolution suite's JSON files (benches/conv_suite.rs --json A,
benches/pytorch/conv_suite.py --json B) and prints, per problem-direction, nnfuse's GPU time
against PyTorch's (ratio > 1: nnfuse faster), host times and first-call times, then the
geometric mean, the worst ratio, the count below 0.95 and the first-call percentiles.

    python3 benches/pytorch/compare_conv.py NNFUSE.json PYTORCH.json
    python3 benches/pytorch/compare_conv.py --nnfuse N1.json N2.json N3.json \
        --pytorch P1.json P2.json P3.json

With several files per side (one per process, run alternately by
benches/pytorch/alternate_suite.sh), a row compares each side's median GPU time over its
processes, and shows each side's spread between processes (max / min - 1) and the ratio of
every process pair i (nnfuse run i against PyTorch run i, the way one back-to-back pair
compares). The same kernel reads a few percent apart from one process to the next on the
H100, so one pair cannot tell a slower route from that spread; the medians can. The summary
gives the medians' figures and, for each pair alone, its geometric mean and rows below 0.95x.
"""
import json
import math
import statistics
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


def gmean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def parse_args(argv):
    """(nnfuse files, PyTorch files) from either form of the command line."""
    if argv and argv[0].startswith("--"):
        sides, cur = {"--nnfuse": [], "--pytorch": []}, None
        for a in argv:
            if a in sides:
                cur = sides[a]
            elif cur is None:
                sys.exit(f"compare_conv.py: {a!r} before --nnfuse / --pytorch")
            else:
                cur.append(a)
        nn, pt = sides["--nnfuse"], sides["--pytorch"]
    elif len(argv) == 2:
        nn, pt = [argv[0]], [argv[1]]
    else:
        sys.exit(__doc__)
    if not nn or not pt:
        sys.exit("compare_conv.py: give at least one file per side")
    return nn, pt


def spread(v):
    return max(v) / min(v) - 1.0 if len(v) > 1 else 0.0


def main():
    nn_files, pt_files = parse_args(sys.argv[1:])
    nn_runs, pt_runs = [load(f) for f in nn_files], [load(f) for f in pt_files]
    keys = [k for k in nn_runs[0] if all(k in r for r in nn_runs + pt_runs)]
    multi = len(nn_runs) > 1 or len(pt_runs) > 1
    pairs = min(len(nn_runs), len(pt_runs))
    head = ("| problem | type | dir | nnfuse route | nnfuse GPU µs | PyTorch GPU µs | speed-up | "
            "host µs nnfuse / PyTorch | first ms nnfuse / PyTorch |")
    if multi:
        head += " spread nnfuse / PyTorch | ratio per pair |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    ratios, firsts, pair_ratios = [], [], [[] for _ in range(pairs)]
    for k in keys:
        a = [r[k] for r in nn_runs]
        b = [r[k] for r in pt_runs]
        ga = statistics.median(x["gpu_us"] for x in a)
        gb = statistics.median(x["gpu_us"] for x in b)
        r = gb / ga
        ratios.append(r)
        firsts.extend(x["first_ms"] for x in a)
        routes = sorted({x["route"] for x in a})
        line = (f"| {k[0]} | {a[0]['dtype']} | {k[1]} | {' / '.join(routes)} | {ga:.1f} | {gb:.1f} | "
                f"{r:.2f}x | {statistics.median(x['host_us'] for x in a):.1f} / "
                f"{statistics.median(x['host_us'] for x in b):.1f} | "
                f"{statistics.median(x['first_ms'] for x in a):.0f} / "
                f"{statistics.median(x['first_ms'] for x in b):.0f} |")
        if multi:
            per_pair = [b[i]["gpu_us"] / a[i]["gpu_us"] for i in range(pairs)]
            for i, pr in enumerate(per_pair):
                pair_ratios[i].append(pr)
            line += (f" {100 * spread([x['gpu_us'] for x in a]):.1f}% / "
                     f"{100 * spread([x['gpu_us'] for x in b]):.1f}% | "
                     f"{' '.join(f'{pr:.2f}' for pr in per_pair)} |")
        print(line)
    if not ratios:
        print("no common rows")
        return
    worst = min(zip(ratios, keys))
    what = (f"median of {len(nn_runs)} nnfuse and {len(pt_runs)} PyTorch processes"
            if multi else "one process each")
    print(f"\n{len(ratios)} problem-directions ({what}): geometric mean {gmean(ratios):.3f}x PyTorch, "
          f"worst {worst[0]:.2f}x ({worst[1][0]} {worst[1][1]}), {sum(r < 0.95 for r in ratios)} below "
          f"0.95x, {sum(r < 0.9 for r in ratios)} below 0.90x")
    if multi:
        for i, pr in enumerate(pair_ratios):
            w = min(zip(pr, keys))
            print(f"pair {i + 1} alone: geometric mean {gmean(pr):.3f}x, worst {w[0]:.2f}x "
                  f"({w[1][0]} {w[1][1]}), {sum(x < 0.95 for x in pr)} below 0.95x")
    print(f"nnfuse first call (one direction): median {pct(firsts, 0.5):.0f} ms, p95 {pct(firsts, 0.95):.0f} ms, "
          f"max {max(firsts):.0f} ms")


if __name__ == "__main__":
    main()
