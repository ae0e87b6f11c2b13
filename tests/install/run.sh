#!/usr/bin/env bash
# accel as a user installs it: `cmake --install` into a fresh prefix, then examples/standalone (a
# project of its own: find_package(accel), C++17 asked for) built against that prefix alone and
# run with the installed accel-launch on 2 processes; the pkg-config file, the installed CLIs and
# the installed systemd unit are checked too. Bounded; removes what it made.
#   tests/install/run.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: run.sh BUILD_DIR}" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d /tmp/accel-install.XXXXXX)
trap 'rm -rf "$W"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
P="$W/prefix"

echo "== cmake --install --prefix (stripped)"
timeout 300 cmake --install "$build" --prefix "$P" --strip >"$W/install.log" 2>&1 ||
  fail "cmake --install failed: $(tail -n 5 "$W/install.log")"
for f in bin/accel-launch bin/accel-launch-cluster bin/accel-agent bin/accel bin/accel-check \
  lib/libaccel.a include/accel/accel.h lib/cmake/accel/accelConfig.cmake \
  lib/cmake/accel/accelConfigVersion.cmake lib/pkgconfig/accel.pc \
  lib/systemd/system/accel-agent.service share/accel/configs/slurm/train.sbatch \
  share/doc/accel/README.md; do
  [[ -e "$P/$f" ]] || fail "not installed: $f"
done
grep -q "^ExecStart=$P/bin/accel-agent " "$P/lib/systemd/system/accel-agent.service" ||
  fail "the installed unit does not run the installed agent"
"$P/bin/accel-agent" --help >/dev/null || fail "installed accel-agent --help"
"$P/bin/accel-launch" --version
if command -v systemd-analyze >/dev/null; then
  timeout 60 systemd-analyze verify "$P/lib/systemd/system/accel-agent.service" ||
    fail "systemd-analyze verify refuses the installed unit"
  echo "systemd-analyze verify: the installed unit is valid"
fi

echo "== pkg-config"
flags=$(PKG_CONFIG_PATH="$P/lib/pkgconfig" pkg-config --cflags --libs accel) || fail "pkg-config"
echo "$flags"
inc_ok=0
lib_ok=0
for f in $flags; do
  case "$f" in
    -I*) [[ -f "${f#-I}/accel/accel.h" ]] && inc_ok=1 ;;
    -L*) [[ -f "${f#-L}/libaccel.a" ]] && lib_ok=1 ;;
  esac
done
[[ $inc_ok -eq 1 && $lib_ok -eq 1 && "$flags" == *"-laccel"* && "$flags" == *"-ltorch"* ]] ||
  fail "pkg-config's flags do not lead to the installed headers and libaccel.a, or lack libtorch"

echo "== examples/standalone against the installed package (CMAKE_CXX_STANDARD=17)"
cp -r "$root/examples/standalone" "$W/standalone"
timeout 300 cmake -S "$W/standalone" -B "$W/standalone/build" -G Ninja -DCMAKE_PREFIX_PATH="$P" \
  -DCMAKE_CXX_STANDARD=17 -DCMAKE_BUILD_TYPE=Release >"$W/configure.log" 2>&1 ||
  fail "configure failed: $(tail -n 20 "$W/configure.log")"
timeout 600 cmake --build "$W/standalone/build" >"$W/build.log" 2>&1 ||
  fail "build failed: $(tail -n 30 "$W/build.log")"
grep -q -- "-std=c++20\|-std=gnu++20" "$W/standalone/build/compile_commands.json" 2>/dev/null ||
  grep -rq -- "-std=c++20\|-std=gnu++20" "$W/standalone/build/build.ninja" ||
  fail "accel::runtime did not bring C++20"
out=$(cd "$W" && timeout 120 "$P/bin/accel-launch" -q -n 2 ./standalone/build/train 2>&1) ||
  fail "the installed accel-launch -n 2 failed: $out"
echo "$out"
grep -qE "weight (2\.99|3\.00)[0-9]* bias -(0\.99|1\.00)[0-9]* processes 2" <<<"$out" ||
  fail "the standalone program did not learn y = 3x - 1 on 2 processes"
echo "== the installed accel test -n 2 (accel, accel-launch and accel-check find each other)"
(cd "$W" && timeout 300 "$P/bin/accel" test -n 2 >"$W/accel-test.log" 2>&1) ||
  fail "installed accel test -n 2 failed: $(tail -n 20 "$W/accel-test.log")"
tail -n 3 "$W/accel-test.log"
echo "PASS: installed package, pkg-config, out-of-tree build, installed accel-launch -n 2, accel test"
