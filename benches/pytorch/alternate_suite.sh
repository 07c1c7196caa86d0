#!/usr/bin/env bash
# alternate_suite.sh: the convolution suite against PyTorch over several processes per side,
# alternated (nnfuse then PyTorch, then PyTorch then nnfuse, ...), joined by compare_conv.py
# on each side's median. One back-to-back pair of processes cannot separate a slower route
# from the spread between processes (the same cuDNN kernel read 149–160 µs in different
# processes on one H100); several alternated pairs can.
#
#   benches/pytorch/alternate_suite.sh [-n ROUNDS] [-f FILTER] [-p] OUTDIR [-- NNFUSE_SUITE_COMMAND...]
#
# ROUNDS (default 3) processes per side; FILTER selects problems by name (both sides); -p runs
# every problem in a process of its own (each side, each round), as a framework's first layer
# meets it: a cold process (cuDNN's engines loaded by that problem's first listing);
# OUTDIR receives n<i>.json / p<i>.json, each process's log and compare.md. The nnfuse command
# defaults to the staged bench (`scripts/gpu-stage`): .gpu/run --exec .gpu/bin/bench/conv_suite
# --bench; where Rust is installed, `-- cargo bench --bench conv_suite --` works too. Run from
# the repository root on the GPU machine. Exit status: non-zero when any process failed.
set -uo pipefail

rounds=3 filter="" per_problem=0
while getopts "n:f:p" o; do
  case $o in
    n) rounds=$OPTARG ;;
    f) filter=$OPTARG ;;
    p) per_problem=1 ;;
    *) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
out=${1:?usage: alternate_suite.sh [-n ROUNDS] [-f FILTER] OUTDIR [-- COMMAND...]}
shift
[ "${1:-}" = "--" ] && shift
cmd=("$@")
[ ${#cmd[@]} -gt 0 ] || cmd=(.gpu/run --exec .gpu/bin/bench/conv_suite --bench)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$out"
fargs=()
[ -n "$filter" ] && fargs=(--filter "$filter")

fails=0
# One side's run $2 (n or p) of round $1, over FILTER's problems in one process, or (-p) one
# process per problem, its rows kept where the name matches exactly (the filter is a substring).
side() {
  local i=$1 tag=$2 name json log
  shift 2
  json=$out/$tag$i.json log=$out/$tag-$i.log
  if [ $per_problem = 0 ]; then
    "$@" "${fargs[@]}" --json "$json" > "$log" 2>&1 \
      || { echo "alternate_suite: $tag run $i failed (rc $?, $log)" >&2; fails=$((fails + 1)); }
    return
  fi
  : > "$json"; : > "$log"
  for name in "${names[@]}"; do
    "$@" --filter "$name" --json "$out/one.json" >> "$log" 2>&1 \
      || { echo "alternate_suite: $tag run $i, $name failed (rc $?, $log)" >&2; fails=$((fails + 1)); }
    python3 -c 'import json, sys
for l in open(sys.argv[1]):
    if l.strip() and json.loads(l)["problem"] == sys.argv[2]:
        print(l.strip())' "$out/one.json" "$name" >> "$json"
  done
  rm -f "$out/one.json"
}
run_nnfuse() { side "$1" n "${cmd[@]}"; }
run_pytorch() { side "$1" p python3 "$here/conv_suite.py"; }
names=()
if [ $per_problem = 1 ]; then
  while read -r name _; do
    case $name in ''|'#'*) continue ;; esac
    [[ $name == *"$filter"* ]] && names+=("$name")
  done < "$here/../conv_problems.txt"
fi

nn=() pt=()
for i in $(seq 1 "$rounds"); do
  # Which side goes first alternates, so that a drift of the machine over the run (clocks,
  # temperature) falls on both sides alike.
  if [ $((i % 2)) = 1 ]; then run_nnfuse "$i"; run_pytorch "$i"; else run_pytorch "$i"; run_nnfuse "$i"; fi
  echo "alternate_suite: round $i of $rounds done"
  nn+=("$out/n$i.json") pt+=("$out/p$i.json")
done
[ $fails = 0 ] || exit 1
python3 "$here/compare_conv.py" --nnfuse "${nn[@]}" --pytorch "${pt[@]}" > "$out/compare.md"
grep -E "problem-directions|^pair " "$out/compare.md"
