#!/usr/bin/env bash
# nnfuse's test command: sets up what a fresh machine lacks, then runs every CPU test.
#  - NVRTC: when libnvrtc.so.13 is not already loadable, installs NVIDIA's wheel into .nvrtc/
#    (pip, ~90 MB, once) and puts it on LD_LIBRARY_PATH, so that every kernels/*.cu is compiled
#    for sm_80 and sm_90 by the tests (NNFUSE_REQUIRE_NVRTC=1: a missing NVRTC fails).
#  - Then `cargo test` (GPU tests are #[ignore]d here; run them on a GPU with .gpu/run).
# Extra arguments go to cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."

nvrtc_dir="$PWD/.nvrtc/nvidia/cu13/lib"
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so\.13' && [ ! -e "$nvrtc_dir/libnvrtc.so.13" ]; then
  echo "scripts/test.sh: installing NVIDIA's NVRTC wheel into .nvrtc/ (once)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .nvrtc \
    "nvidia-cuda-nvrtc==13.0.*"
fi
if [ -d "$nvrtc_dir" ]; then
  export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export NNFUSE_REQUIRE_NVRTC=1
exec cargo test "$@"
