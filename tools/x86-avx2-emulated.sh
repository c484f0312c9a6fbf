#!/usr/bin/env bash
# Runs kvpool's tests on an x86-64 CPU without AVX-512, emulated (qemu user mode), on any
# x86-64 Linux machine: the CPUID that torch, oneDNN and the native kernels read is
# qemu's, which offers AVX2 and FMA and no AVX-512, BF16 or AMX.
#
#   tools/x86-avx2-emulated.sh [pytest arguments...]
#
# Default: the tests of the native kernels and of the runtime's choices (a long hour on
# 2 cores: ~30x slower than natively). Needs this checkout's `make setup` and Debian's
# qemu-user (installed here with apt-get when missing and run as root).
#
# What it shows, beside a run narrowed with KVPOOL_CPU_FEATURES=avx2: the whole process
# sees a CPU without AVX-512, so torch takes its AVX2 kernels, oneDNN reports no bf16
# products, and the native module picks its AVX2 variant by the CPUID instruction, as
# on an AVX2-only machine. Every Python process a test starts with sys.executable runs
# emulated too (the interpreter is started as .venv/bin/python-avx2, which it then reports
# as its own). Not emulated: programs a test starts by another path (a console script).
# It says nothing about an AVX2-only CPU's speed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
python=.venv/bin/python
[ -x "$python" ] || { echo "run 'make setup' first" >&2; exit 2; }

if ! command -v qemu-x86_64 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null
  else
    echo "needs qemu-x86_64 (Debian: apt-get install qemu-user)" >&2
    exit 2
  fi
fi

# The interpreter under qemu. qemu's -0 gives the program the wrapper's path as argv[0],
# which Python takes for sys.executable (so the children tests start run emulated) and
# from which it finds the virtual environment (.venv/pyvenv.cfg).
real=$(readlink -f "$python")
wrapper=$repo/.venv/bin/python-avx2
cat > "$wrapper" <<EOF
#!/bin/sh
exec qemu-x86_64 -cpu max -0 "$wrapper" "$real" "\$@"
EOF
chmod +x "$wrapper"

# The native module is built natively first (its build is the same for every CPU: the
# kernels are chosen at run time), so that g++ does not run under emulation.
"$python" -c "from kvpool.model.native import native_ops, unavailable_reason
assert native_ops() is not None, unavailable_reason()"

# The emulated CPU must be what this run claims to test.
"$wrapper" - <<'EOF'
import torch
from kvpool.model.cpu import cpu_features
from kvpool.model.native import kernel_variant, native_ops

cpu = cpu_features()
# qemu 7.2 reads a subnormal half float as zero in VCVTPH2PS under MXCSR's DAZ, as no x86
# core does: kvpool then flushes under FTZ alone (float_control.h), and says so here
flush = {0x8040: "FTZ and DAZ", 0x8000: "FTZ alone (this CPU's half-float conversion "
         "reads subnormals as zero under DAZ)"}[native_ops().flush_control()]
print(f"emulated: {cpu.summary()}; torch's kernels {torch.backends.cpu.get_cpu_capability()}; "
      f"kvpool's {kernel_variant()}; subnormals flushed under {flush}")
assert cpu.avx2 and not cpu.avx512 and not cpu.bf16_products, cpu
assert kernel_variant() == "avx2", kernel_variant()
EOF

if [ $# -eq 0 ]; then
  set -- tests/test_cpu_choice.py tests/test_native_ops.py tests/test_quant_products.py \
    tests/test_int4_products.py tests/test_measured.py tests/test_kv_dtype.py \
    tests/test_decode_layers.py tests/test_crossover.py tests/test_synthetic_models.py \
    tests/test_gather_bound.py tests/test_sliding_window.py \
    tests/test_shared_prefix_attention.py tests/test_models.py tests/test_model_reference.py
fi
exec "$wrapper" -m pytest -p no:cacheprovider "$@"
