#!/usr/bin/env bash
# The node on arm64 (Grace-class hosts are CPU attention's natural home): the attention crate, where
# the arch-specific kernels live (NEON and portable), must lint clean for aarch64 and its tests
# (kernels against their references, planners, residency) must pass there, run under qemu.
# The rest of the workspace is not cross-linked here: checking it for aarch64 builds every
# dependency again for that target (ring's and esaxx's C among them), 5.5 of the phase's 7 minutes
# on CI's two cores, for the few `target_arch` arms of decode-node's CPU backend. To check it by hand:
#   cargo clippy --workspace --all-targets --target aarch64-unknown-linux-gnu -- -D warnings
# Needs rustup's aarch64 standard library, a cross linker and qemu-user; as root it installs the
# last two from Debian's packages. Says "skipped" and exits 0 when one cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
skip() { echo "warning: arm64 check skipped: $1" >&2; exit 0; }

rustup target list --installed 2>/dev/null | grep -qx "$target" \
  || rustup target add "$target" >/dev/null 2>&1 \
  || skip "rustup could not add $target"
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  [ "$(id -u)" = 0 ] || skip "no aarch64-linux-gnu-gcc or qemu-aarch64, and not root to install them"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user) >/dev/null \
    || skip "could not install gcc-aarch64-linux-gnu and qemu-user"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo clippy --locked -p attention --all-targets --target "$target" -- -D warnings
cargo test --locked -p attention --target "$target"
