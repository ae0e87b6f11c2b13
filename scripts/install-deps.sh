#!/usr/bin/env bash
# Installs every Debian 12 package accel needs to build, test and benchmark.
# Idempotent: when everything is already installed it changes nothing and runs no apt-get.
# Needs root (or sudo) for apt-get; non-interactive.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build ccache pkg-config git
  # scripts/gpu-check.sh --pack: launcher binaries that find their libraries beside them
  patchelf
  # control plane
  libboost-dev libboost-filesystem-dev libboost-system-dev
  libgrpc++-dev libabsl-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libssl-dev
  libyaml-cpp-dev libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libsystemd-dev
  # runtime: CPU libtorch + c10d/gloo; OpenBLAS (the reference BLAS is ~9x slower); xxhash
  # (header-only, checkpoint checksums)
  libtorch-dev libgloo-dev libopenblas0-pthread libxxhash-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev python3 python3-torch python3-numpy procps psmisc openssl
  # the multi-host test bed's faults (tests/multihost/bed.sh: partitions, packet loss)
  iptables
  # bed_delay's NFQUEUE delayer (bench/multihost/nfq_delay.c; the kernel may lack netem) and ping
  libnetfilter-queue-dev iputils-ping
  # the independent reader of TensorBoard files in the tracking test
  python3-protobuf
  # fuzzing (fuzz/): clang with libFuzzer and the sanitizers
  clang-14 libfuzzer-14-dev
  # formatting check (scripts/check-format.sh, run by the tests)
  clang-format-14
  # the metrics test (tests/observe/run.sh): a real Prometheus scrapes accel and headless Chromium
  # loads its status page
  prometheus chromium curl
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
