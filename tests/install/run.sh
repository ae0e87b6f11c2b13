#!/usr/bin/env bash
# accel as a user installs it, twice:
#  1. `cmake --install` into a fresh prefix;
#  2. the Debian package `cpack -G DEB` makes, installed with apt-get (as root; then purged).
# For each: the files and the systemd unit are where they belong, libaccel.so has its SONAME,
# pkg-config leads to it, examples/standalone (a project of its own: find_package(accel), C++17
# asked for) builds against the installed files alone and runs under the installed
# accel-launch -n 2, and the installed `accel test -n 2` passes. Bounded; removes what it made.
#   tests/install/run.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: run.sh BUILD_DIR}" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d /tmp/accel-install.XXXXXX)
deb_installed=0
had_user=0
getent passwd accel >/dev/null && had_user=1
cleanup() {
  if [[ $deb_installed -eq 1 ]]; then
    DEBIAN_FRONTEND=noninteractive timeout 120 apt-get purge -y -q accel >/dev/null 2>&1 ||
      dpkg --purge accel >/dev/null 2>&1 || true
  fi
  # Why: the package leaves its system user behind (Debian's way); this machine gets back the
  # state it had, so a later test (systemd's) sees no accel user it did not make.
  if [[ $had_user -eq 0 ]] && getent passwd accel >/dev/null; then
    userdel accel >/dev/null 2>&1 || true
    groupdel accel >/dev/null 2>&1 || true
  fi
  rm -rf "$W"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
version=$(sed -n 's/^project(accel VERSION \([0-9.]*\) .*/\1/p' "$root/CMakeLists.txt")
soname="libaccel.so.${version%.*}" # 0.2.0 -> libaccel.so.0.2

# check_installed PREFIX: everything a user of PREFIX relies on (PREFIX/bin, PREFIX/lib, ...).
check_installed() {
  local P=$1 tag=$2
  for f in bin/accel-launch bin/accel-launch-cluster bin/accel-agent bin/accel bin/accel-check \
    lib/libaccel.so "lib/$soname" include/accel/accel.h lib/cmake/accel/accelConfig.cmake \
    lib/cmake/accel/accelConfigVersion.cmake lib/pkgconfig/accel.pc \
    lib/systemd/system/accel-agent.service share/accel/configs/slurm/train.sbatch \
    share/doc/accel/README.md; do
    [[ -e "$P/$f" ]] || fail "$tag: not installed: $f"
  done
  # Why a variable: with pipefail, grep -q quitting at its match can SIGPIPE objdump (the
  # output is longer than a pipe's buffer) and fail the pipeline although the SONAME is right.
  local headers
  headers=$(objdump -p "$P/lib/libaccel.so")
  grep -q "SONAME *$soname\$" <<<"$headers" ||
    fail "$tag: libaccel.so's SONAME is not $soname: $(grep SONAME <<<"$headers")"
  grep -q "^ExecStart=$P/bin/accel-agent " "$P/lib/systemd/system/accel-agent.service" ||
    fail "$tag: the installed unit does not run the installed agent"
  "$P/bin/accel-agent" --help >/dev/null || fail "$tag: installed accel-agent --help"
  "$P/bin/accel-launch" --version
  if grep -q "not found" <<<"$(ldd "$P/bin/accel-check")"; then
    fail "$tag: accel-check does not find a library: $(ldd "$P/bin/accel-check" | grep 'not found')"
  fi
  if command -v systemd-analyze >/dev/null; then
    timeout 60 systemd-analyze verify "$P/lib/systemd/system/accel-agent.service" ||
      fail "$tag: systemd-analyze verify refuses the installed unit"
    echo "systemd-analyze verify: the installed unit is valid"
    local exposure
    exposure=$(timeout 60 systemd-analyze security --offline=true \
      "$P/lib/systemd/system/accel-agent.service" 2>&1 | sed -n 's/.*Overall exposure level for .*: \([0-9.]*\) .*/\1/p')
    [[ -n "$exposure" ]] || fail "$tag: systemd-analyze security printed no exposure level"
    awk -v e="$exposure" 'BEGIN { exit !(e <= 4.0) }' ||
      fail "$tag: systemd-analyze security rates the installed unit $exposure, above 4.0"
    echo "systemd-analyze security: the installed unit's exposure is $exposure (at most 4.0)"
  fi
  grep -q "^ExecStart=$P/bin/accel-agent " "$P/share/accel/configs/systemd/accel-agent.service" ||
    fail "$tag: the unit among the installed examples does not run the installed agent"

  echo "== $tag: pkg-config"
  local flags inc_ok=0 lib_ok=0
  flags=$(PKG_CONFIG_PATH="$P/lib/pkgconfig" pkg-config --cflags --libs accel) || fail "pkg-config"
  echo "$flags"
  for f in $flags; do
    case "$f" in
      -I*) [[ -f "${f#-I}/accel/accel.h" ]] && inc_ok=1 ;;
      -L*) [[ -f "${f#-L}/libaccel.so" ]] && lib_ok=1 ;;
    esac
  done
  [[ $inc_ok -eq 1 && $lib_ok -eq 1 && "$flags" == *"-laccel"* && "$flags" == *"-ltorch"* ]] ||
    fail "$tag: pkg-config's flags do not lead to the installed headers and libaccel.so, or lack libtorch"

  echo "== $tag: examples/standalone against the installed package (CMAKE_CXX_STANDARD=17)"
  local S="$W/standalone-$tag"
  cp -r "$root/examples/standalone" "$S"
  timeout 300 cmake -S "$S" -B "$S/build" -G Ninja -DCMAKE_PREFIX_PATH="$P" \
    -DCMAKE_CXX_STANDARD=17 -DCMAKE_BUILD_TYPE=Release >"$W/configure.log" 2>&1 ||
    fail "$tag: configure failed: $(tail -n 20 "$W/configure.log")"
  timeout 600 cmake --build "$S/build" >"$W/build.log" 2>&1 ||
    fail "$tag: build failed: $(tail -n 30 "$W/build.log")"
  grep -rq -- "-std=c++20\|-std=gnu++20" "$S/build/build.ninja" ||
    fail "$tag: accel::runtime did not bring C++20"
  local out
  out=$(cd "$W" && timeout 120 "$P/bin/accel-launch" -q -n 2 "$S/build/train" 2>&1) ||
    fail "$tag: the installed accel-launch -n 2 failed: $out"
  echo "$out"
  grep -qE "weight (2\.99|3\.00)[0-9]* bias -(0\.99|1\.00)[0-9]* processes 2" <<<"$out" ||
    fail "$tag: the standalone program did not learn y = 3x - 1 on 2 processes"
  echo "== $tag: the installed accel test -n 2 (accel, accel-launch and accel-check find each other)"
  (cd "$W" && timeout 300 "$P/bin/accel" test -n 2 >"$W/accel-test.log" 2>&1) ||
    fail "$tag: installed accel test -n 2 failed: $(tail -n 20 "$W/accel-test.log")"
  tail -n 3 "$W/accel-test.log"
}

echo "== cmake --install --prefix (stripped)"
timeout 300 cmake --install "$build" --prefix "$W/prefix" --strip >"$W/install.log" 2>&1 ||
  fail "cmake --install failed: $(tail -n 5 "$W/install.log")"
[[ -f "$W/prefix/etc/accel/agent.yaml" ]] || fail "prefix: not installed: etc/accel/agent.yaml"
check_installed "$W/prefix" prefix
echo "PASS: cmake --install: files, SONAME, pkg-config, out-of-tree build, accel-launch -n 2, accel test"

echo "== cpack -G DEB"
if [[ $(id -u) -ne 0 ]] || ! command -v dpkg-deb >/dev/null || ! command -v apt-get >/dev/null; then
  echo "SKIP: the .deb needs root, dpkg and apt-get"
  exit 0
fi
if dpkg -s accel >/dev/null 2>&1; then
  echo "SKIP: a package named accel is installed already; not replacing it"
  exit 0
fi
(cd "$W" && timeout 600 cpack -G DEB -B "$W/deb" --config "$build/CPackConfig.cmake" \
  >"$W/cpack.log" 2>&1) || fail "cpack failed: $(tail -n 20 "$W/cpack.log")"
deb="$W/deb/accel_${version}_amd64.deb"
[[ -f "$deb" ]] || fail "no $deb: $(ls "$W/deb")"
ls -l "$deb" | awk '{print $5, $NF}'
info=$(dpkg-deb -f "$deb" Package Version Architecture Depends Recommends)
echo "$info"
for dep in libtorch1.13 'libgrpc++1' libprotobuf libyaml-cpp libopenblas0-pthread adduser; do
  grep -q "^Depends:.*$dep" <<<"$info" || fail "the package does not depend on $dep"
done
[[ $(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles) == "/etc/accel/agent.yaml" ]] ||
  fail "/etc/accel/agent.yaml is not a conffile"
dpkg-deb -c "$deb" >"$W/contents"
for f in ./usr/lib/systemd/system/accel-agent.service ./etc/accel/agent.yaml ./usr/bin/accel-launch \
  "./usr/lib/$soname" ./usr/include/accel/accel.h ./usr/lib/cmake/accel/accelConfig.cmake; do
  grep -qE " $f( -> .*)?\$" "$W/contents" || fail "$f is not in the package"
done

echo "== apt-get install ./$(basename "$deb")"
deb_installed=1
DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends "$deb" \
  >"$W/apt.log" 2>&1 || fail "apt-get install failed: $(tail -n 20 "$W/apt.log")"
id accel || fail "postinst did not create the accel user"
[[ $(stat -c '%G %a' /etc/accel/agent.yaml) == "accel 640" ]] ||
  fail "/etc/accel/agent.yaml is $(stat -c '%G %a' /etc/accel/agent.yaml), not group accel 640"
if [[ -d /run/systemd/system ]]; then
  systemctl is-enabled accel-agent >/dev/null 2>&1 && fail "the package enabled the agent"
  systemctl is-active accel-agent >/dev/null 2>&1 && fail "the package started the agent"
fi
command -v accel-launch | grep -qx /usr/bin/accel-launch || fail "accel-launch is not /usr/bin's"
check_installed /usr deb
DEBIAN_FRONTEND=noninteractive timeout 120 apt-get purge -y -q accel >"$W/purge.log" 2>&1 ||
  fail "apt-get purge failed: $(tail -n 20 "$W/purge.log")"
deb_installed=0
[[ ! -e /usr/bin/accel-launch && ! -e /etc/accel/agent.yaml ]] || fail "purge left files behind"
echo "PASS: .deb: dependencies, conffile, unit, accel user, nothing started, out-of-tree build, accel-launch -n 2, accel test, purge"
