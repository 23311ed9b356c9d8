#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine of this kind: Debian packages the tests need,
# rust-src for the toolchain pinned in rust-toolchain.toml (it builds the probes with -Z build-std),
# bpf-linker built against that toolchain's own LLVM, cargo-nextest where the machine lacks it, and containerd 2.x from Debian unstable (the second
# containerd the integration tests run under), both cached under $BATON_CACHE.
# Prints two lines on stdout: the folder of bpf-linker, then the folder of containerd 2.x's binaries
# (containerd, ctr, containerd-shim-runc-v2).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (installs Debian packages, loads eBPF, mounts FUSE): run it with sudo"

# Everything the tests use: tools/dev test runs them in strict mode, where a missing one fails its test.
# python3: the dup/fork/exec tracing script; bsdutils: `script` (a tty for ctr -t); util-linux: setpriv,
# unshare (tools/baton/tests/install.rs: a read-only bind mount); python3-venv: kubernetes-validate below;
# systemd: systemd-analyze verify of the agent's unit (tools/baton/tests/install.rs).
# chromium: the timeline test renders `baton trace --html` pages headless.
# podman: integration/tests/oci_hooks.rs runs a container with podman and the example hooks.d of runc-hooks/;
# tools/image/build makes the node image with it (tools/dev image, integration/tests/kube_manifests.rs).
DEB_PKGS=(containerd runc fuse3 libfuse3-dev pkg-config busybox-static iproute2 procps protobuf-compiler criu
  python3 python3-venv bsdutils util-linux systemd chromium podman)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed: the Debian package mirror is not reachable"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed (see the output above)"
fi

command -v rustup >/dev/null || die "rustup not found: install Rust with rustup first"
TOOLCHAIN=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
[ -n "$TOOLCHAIN" ] || die "rust-toolchain.toml names no channel"
rustup toolchain list | grep -q "^$TOOLCHAIN" || rustup toolchain install "$TOOLCHAIN" --profile minimal \
  || die "cannot install Rust toolchain $TOOLCHAIN"
for c in rust-src clippy rustfmt; do
  rustup component list --toolchain "$TOOLCHAIN" --installed | grep -q "^$c" \
    || rustup component add "$c" --toolchain "$TOOLCHAIN" >/dev/null \
    || die "rustup component add $c --toolchain $TOOLCHAIN failed: the probes need rust-src for -Z build-std=core"
done

BATON_CACHE=${BATON_CACHE:-/var/cache/baton}
BPF_LINKER_VERSION=0.13.0
LINKER_ROOT="$BATON_CACHE/bpf-linker-$BPF_LINKER_VERSION-$TOOLCHAIN"
if [ ! -x "$LINKER_ROOT/bin/bpf-linker" ]; then
  sysroot=$(rustc +"$TOOLCHAIN" --print sysroot)
  llvm_so=$(ls "$sysroot"/lib/libLLVM.so.*-rust-* 2>/dev/null | head -n1)
  [ -n "$llvm_so" ] || die "no libLLVM.so.*-rust-* in $sysroot/lib: cannot build bpf-linker against the toolchain's LLVM"
  major=$(basename "$llvm_so" | sed -n 's/^libLLVM\.so\.\([0-9]*\)\..*/\1/p')
  prefix="$BATON_CACHE/llvm-prefix-$TOOLCHAIN"
  mkdir -p "$prefix/lib"
  ln -sf "$llvm_so" "$prefix/lib/libLLVM.so"
  say "building bpf-linker $BPF_LINKER_VERSION against $(basename "$llvm_so") (a few minutes, once)"
  LLVM_PREFIX="$prefix" RUSTFLAGS="-C link-arg=-Wl,-rpath,$sysroot/lib" \
    cargo +"$TOOLCHAIN" install bpf-linker --locked --version "$BPF_LINKER_VERSION" \
      --no-default-features --features "llvm-$major" --root "$LINKER_ROOT" \
    || die "building bpf-linker failed: needs crates.io and the toolchain's libLLVM ($llvm_so)"
fi
# A plain `cargo build` finds bpf-linker on PATH (cargo puts ~/.cargo/bin there).
mkdir -p "$HOME/.cargo/bin"
ln -sf "$LINKER_ROOT/bin/bpf-linker" "$HOME/.cargo/bin/bpf-linker"

# cargo-nextest runs the test suite (tools/dev test, tools/nextest.toml). Machines of this kind come with it
# (/usr/local/bin); where it is missing or older than the config needs, it is built from crates.io into the
# cache, once (a few minutes).
NEXTEST_VERSION=0.9.143
if ! cargo nextest --version 2>/dev/null | awk 'NR==1 {split($2, v, "."); exit !(v[1] > 0 || v[2] > 9 || (v[2] == 9 && v[3] >= 100))}'; then
  NEXTEST_ROOT="$BATON_CACHE/cargo-nextest-$NEXTEST_VERSION"
  if [ ! -x "$NEXTEST_ROOT/bin/cargo-nextest" ]; then
    say "building cargo-nextest $NEXTEST_VERSION (crates.io) into $NEXTEST_ROOT (a few minutes, once)"
    cargo +"$TOOLCHAIN" install cargo-nextest --locked --version "$NEXTEST_VERSION" --root "$NEXTEST_ROOT" >&2 \
      || die "building cargo-nextest $NEXTEST_VERSION failed: needs crates.io"
  fi
  ln -sf "$NEXTEST_ROOT/bin/cargo-nextest" "$HOME/.cargo/bin/cargo-nextest"
fi

# kubernetes-validate (PyPI; it bundles the Kubernetes OpenAPI schemas and works offline) checks the manifests
# under tools/kubernetes/ in tools/baton/tests/manifests.rs, since no cluster runs here. In a venv of its own,
# on PATH beside bpf-linker.
KUBERNETES_VALIDATE_VERSION=1.37.0
KV_VENV="$BATON_CACHE/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION"
if [ ! -x "$KV_VENV/bin/kubernetes-validate" ]; then
  say "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION (PyPI) into $KV_VENV"
  python3 -m venv "$KV_VENV" || die "python3 -m venv failed: install python3-venv"
  "$KV_VENV/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" >&2 \
    || die "pip install kubernetes-validate==$KUBERNETES_VALIDATE_VERSION failed: needs PyPI"
fi
ln -sf "$KV_VENV/bin/kubernetes-validate" "$HOME/.cargo/bin/kubernetes-validate"

# A private apt state for Debian unstable in folder $1 (its own sources list, package lists and cache; the
# system's packages and apt state are not touched), its package lists updated; sets UNSTABLE_APT to the options
# that make apt-get and apt-cache use it. Dir::State::status=/dev/null: nothing counts as installed (the
# system's containerd 1.6 is not a candidate; a download takes a package's whole dependency closure). The
# downloads go to folders of root's, where apt's sandbox user could not write, so apt runs them as root.
unstable_apt() {
  local tmp=$1 mirror=${BATON_DEBIAN_MIRROR:-http://deb.debian.org/debian}
  chmod 755 "$tmp" # apt's sandbox user (_apt) writes into lists/partial
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/deb"
  echo "deb $mirror sid main" >"$tmp/sources.list"
  UNSTABLE_APT=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o Dir::State::status=/dev/null
    -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
  apt-get "${UNSTABLE_APT[@]}" update -qq --error-on=any >&2 \
    || die "apt-get update of Debian unstable ($mirror sid) failed: the mirror is not reachable (set BATON_DEBIAN_MIRROR to another Debian mirror)"
}

# containerd 2.x: Debian 12 has only 1.6, so the tests' second containerd is Debian unstable's `containerd`
# package (2.1.x; it needs glibc >= 2.34, Debian 12 has 2.36). It is downloaded with a private apt
# state (its own sources list, package lists and cache under a temporary folder) and extracted with dpkg -x
# into $BATON_CACHE/containerd-<Debian version>/root: the system's packages and apt state are not touched.
# A cached copy is reused without asking the mirror again; delete the folder to take a newer one.
containerd2_bin() {
  local cached
  # The newest cached one (an unmatched glob stays as it is, and its --version fails).
  cached=$(printf '%s\n' "$BATON_CACHE"/containerd-2.*/root/usr/bin | sort -V | tail -n1)
  if "$cached/containerd" --version 2>/dev/null | grep -q ' v\?2\.'; then
    echo "$cached"
    return
  fi
  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # $tmp is meant to be expanded now; the function runs in $(...), a subshell
  trap "rm -rf '$tmp'" EXIT
  say "downloading containerd 2.x from Debian unstable into $BATON_CACHE (once)"
  unstable_apt "$tmp"
  local version
  version=$(apt-cache "${UNSTABLE_APT[@]}" show --no-all-versions containerd 2>/dev/null | sed -n 's/^Version: //p' | head -n1)
  [ -n "$version" ] || die "Debian unstable has no containerd package: the tests need containerd 2.x"
  case "${version#*:}" in
    2.*) ;;
    *) die "Debian unstable's containerd is $version, not 2.x: the tests' second pass needs containerd 2.x (pin another source with BATON_DEBIAN_MIRROR, e.g. a snapshot.debian.org archive that has 2.1)" ;;
  esac
  (cd "$tmp/deb" && apt-get "${UNSTABLE_APT[@]}" download -qq "containerd=$version" >&2) \
    || die "apt-get download containerd=$version from Debian unstable failed (see the output above)"
  local dest="$BATON_CACHE/containerd-${version//[:\/]/_}"
  rm -rf "$tmp/root"
  dpkg -x "$tmp"/deb/containerd_*.deb "$tmp/root" || die "dpkg -x of containerd $version failed"
  "$tmp/root/usr/bin/containerd" --version 2>/dev/null | grep -q ' v\?2\.' \
    || die "the downloaded containerd $version does not run here or is not 2.x: $("$tmp/root/usr/bin/containerd" --version 2>&1 | head -n1)"
  rm -rf "$dest"
  mkdir -p "$dest"
  mv "$tmp/root" "$dest/root"
  echo "$dest/root/usr/bin"
}
CONTAINERD2_BIN=$(containerd2_bin)

# CRIU: Debian 12's criu 3.17 fails `criu check` on this kernel ("Could not initialize kernel features
# detection"); Debian unstable's 4.2.x passes it. It needs a newer glibc than Debian 12's, so it runs from a
# cache folder through the loader and libraries of its own packages (criu and the 25 it depends on, extracted
# with dpkg -x; nothing is installed into the system): $BATON_CACHE/criu-<version>/bin/criu runs it that way,
# and $BATON_CACHE/criu links to the newest one, where the shim looks by default (its `criu_path` option
# names another).
criu_bin() {
  local cached="$BATON_CACHE/criu/bin/criu"
  if "$cached" --version 2>/dev/null | grep -q '^Version: 4\.'; then
    echo "$cached"
    return
  fi
  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expanded now, on purpose; the function runs in a subshell
  trap "rm -rf '$tmp'" EXIT
  say "downloading CRIU 4.x and the libraries it links from Debian unstable into $BATON_CACHE (once)"
  unstable_apt "$tmp"
  local version
  version=$(apt-cache "${UNSTABLE_APT[@]}" show --no-all-versions criu 2>/dev/null | sed -n 's/^Version: //p' | head -n1)
  case "${version#*:}" in
    4.*) ;;
    *) die "Debian unstable's criu is '${version:-missing}', not 4.x: the checkpoint tests need CRIU 4 (Debian 12's 3.17 fails criu check on this kernel)" ;;
  esac
  # With no installed packages in its state, apt downloads criu's whole dependency closure (glibc among it).
  apt-get "${UNSTABLE_APT[@]}" install --download-only --no-install-recommends -y -qq "criu=$version" >&2 \
    || die "downloading criu=$version and its libraries from Debian unstable failed (see the output above)"
  local dest="$BATON_CACHE/criu-${version//[:\/]/_}"
  rm -rf "$dest"
  mkdir -p "$dest/bin"
  for deb in "$tmp"/cache/archives/*.deb; do
    dpkg -x "$deb" "$dest/root" || die "dpkg -x $deb failed"
  done
  local lib="$dest/root/usr/lib/x86_64-linux-gnu"
  [ -x "$lib/ld-linux-x86-64.so.2" ] || die "criu $version's packages bring no loader at $lib/ld-linux-x86-64.so.2"
  cat >"$dest/bin/criu" <<SCRIPT
#!/bin/sh
# CRIU $version from Debian unstable, through its own loader and libraries (tools/setup.sh).
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$dest/root/usr/sbin/criu" "\$@"
SCRIPT
  chmod 755 "$dest/bin/criu"
  "$dest/bin/criu" --version 2>/dev/null | grep -q '^Version: 4\.' \
    || die "the downloaded criu $version does not run here: $("$dest/bin/criu" --version 2>&1 | head -n1)"
  ln -sfn "$dest" "$BATON_CACHE/criu"
  echo "$cached"
}
CRIU_BIN=$(criu_bin)

echo "$LINKER_ROOT/bin"
echo "$CONTAINERD2_BIN"
echo "$CRIU_BIN"
