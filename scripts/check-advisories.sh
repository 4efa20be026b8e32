#!/usr/bin/env bash
# Checks Cargo.lock against the RustSec advisory snapshot in deny/, offline (CI cannot reach
# GitHub, where the live database is; see deny/README.md).
#   scripts/check-advisories.sh CARGO_DENY          check, with that cargo-deny binary
#   scripts/check-advisories.sh --refresh DB_CLONE  replace the snapshot from a clone
set -euo pipefail
cd "$(dirname "$0")/.."
snapshot=deny/advisory-db.tar.xz

if [ "${1:-}" = --refresh ]; then
  src=${2:?usage: $0 --refresh DB_CLONE}
  read -r commit date < <(git -C "$src" log -1 --format='%H %cI')
  tar -C "$src" --sort=name --mtime="$date" --owner=0 --group=0 --numeric-owner \
    -cJf "$snapshot" crates support.toml LICENSE.txt LICENSES
  sed -i "s/^snapshot: .*/snapshot: $commit $date/" deny/README.md
  echo "snapshot: $commit $date"
  exit 0
fi

deny=${1:?usage: $0 CARGO_DENY}
read -r commit date < <(sed -n 's/^snapshot: //p' deny/README.md)
root=$PWD/target/advisory-db
# Where cargo-deny 0.20 looks for the database of its default URL under `db-path`.
db=$root/advisory-db-3157b0e258782691
rm -rf "$root"
mkdir -p "$db"
tar -C "$db" -xJf "$snapshot"
# cargo-deny reads the database's age from its HEAD commit: date it as the snapshot.
git -C "$db" init -q
git -C "$db" add -A
GIT_AUTHOR_DATE=$date GIT_COMMITTER_DATE=$date git -C "$db" \
  -c user.name=advisory-snapshot -c user.email=snapshot@localhost commit -q -m "advisory-db $commit"
sed "/^\[advisories\]/a db-path = \"$root\"" deny.toml > "$root/deny.toml"
"$deny" --log-level error --offline --config "$root/deny.toml" check advisories
