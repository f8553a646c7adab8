#!/usr/bin/env bash
# third_party/candle-core and third_party/candle-flash-attn from their crates.io packages and harpe's patches:
# third_party/NAME = the published package NAME-VERSION, less the paths third_party/NAME.patch lists as
# `drop:` in its header, with that patch applied. Why each change: docs/UPSTREAM.md.
#
#   scripts/vendor-candle.sh VERSION                 write third_party/NAME (replacing it)
#   scripts/vendor-candle.sh VERSION --out DIR       write DIR/NAME instead
#   scripts/vendor-candle.sh VERSION --check         compare with third_party/NAME byte for byte (diff -r);
#                                                    CI runs this (.ci/run)
#   scripts/vendor-candle.sh VERSION --write-patch   after editing third_party/NAME: rewrite the diff part of
#                                                    third_party/NAME.patch from it (the header is kept)
#
# A package comes from target/vendor-cache/ (the one cache directory: CI keeps target/), else cargo's registry
# cache, else https://static.crates.io (kept in target/vendor-cache/ from then on). A package of the version
# a patch was made against must have the sha256 that patch's `base:` line records.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$ROOT/target/vendor-cache"
CRATES=(candle-core candle-flash-attn)
ME="scripts/vendor-candle.sh"

die() {
  echo "$ME: $*" >&2
  exit 1
}
usage() {
  sed -n '6,11s/^# \{0,1\}//p' "$0" >&2
  exit 2
}

[[ $# -ge 1 && $1 != -* ]] || usage
VERSION=$1
shift
[[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.+-]+)?$ ]] || die "not a version: '$VERSION'"
MODE=write
OUT="$ROOT/third_party"
while [[ $# -gt 0 ]]; do
  case $1 in
    --check) MODE=check ;;
    --write-patch) MODE=write-patch ;;
    --out)
      [[ $# -ge 2 ]] || usage
      mkdir -p "$2"
      OUT="$(cd "$2" && pwd)"
      shift
      ;;
    *) usage ;;
  esac
  shift
done
for tool in git tar diff; do
  command -v "$tool" >/dev/null || die "$tool not found"
done

TMP="$(mktemp -d "${TMPDIR:-/tmp}/vendor-candle.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

sha256() {
  if command -v sha256sum >/dev/null; then sha256sum "$1"; else shasum -a 256 "$1"; fi | cut -d' ' -f1
}

# The patch's header: its text before the first `diff --git` (git apply skips it).
header() {
  sed '/^diff --git /,$d' "$1"
}

# Prints the path of NAME-VERSION.crate, downloading it into target/vendor-cache/ if no cache has it.
fetch() {
  local name=$1 file="$1-$VERSION.crate" f url
  if [[ -f $CACHE/$file ]]; then
    echo "$CACHE/$file"
    return
  fi
  for f in "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$file"; do
    if [[ -f $f ]]; then
      echo "$f"
      return
    fi
  done
  url="https://static.crates.io/crates/$name/$file"
  command -v curl >/dev/null ||
    die "$file is in no cache (target/vendor-cache/, cargo's registry cache), and curl is missing to download $url"
  mkdir -p "$CACHE"
  echo "$ME: downloading $url" >&2
  if ! curl -fsSL --retry 3 -o "$CACHE/$file.part" "$url"; then
    rm -f "$CACHE/$file.part"
    die "could not download $url (no such version? offline?)"
  fi
  mv "$CACHE/$file.part" "$CACHE/$file"
  echo "$CACHE/$file"
}

# unpack NAME DEST: the published package in DEST, less the patch's drop list.
unpack() {
  local name=$1 dest=$2 patch="$ROOT/third_party/$1.patch" crate base_version base_sha sum p missing=()
  [[ -f $patch ]] || die "third_party/$name.patch not found"
  crate="$(fetch "$name")" || exit 1
  read -r base_version base_sha < <(awk -v n="$name" '$1 == "base:" && $2 == n { print $3, $4; exit }' "$patch") ||
    die "third_party/$name.patch has no 'base: $name VERSION sha256:HEX' line in its header"
  sum="$(sha256 "$crate")"
  if [[ $VERSION == "$base_version" && "sha256:$sum" != "$base_sha" ]]; then
    die "$crate has sha256 $sum, third_party/$name.patch records $base_sha for $name $VERSION:" \
      "a damaged download? Delete the file and run again."
  fi
  mkdir -p "$TMP/unpack-$name"
  tar -xzf "$crate" -C "$TMP/unpack-$name" || die "could not unpack $crate"
  [[ -d $TMP/unpack-$name/$name-$VERSION ]] || die "$crate does not hold the directory $name-$VERSION/"
  mkdir -p "$(dirname "$dest")"
  mv "$TMP/unpack-$name/$name-$VERSION" "$dest"
  while IFS= read -r p; do
    [[ -n $p && $p != /* && $p != *..* ]] ||
      die "third_party/$name.patch: a drop path must be relative, without '..': '$p'"
    if [[ -e $dest/$p || -L $dest/$p ]]; then
      rm -rf "${dest:?}/$p"
    else
      missing+=("$p")
    fi
  done < <(header "$patch" | sed -n 's/^drop: *//p')
  if [[ ${#missing[@]} -gt 0 ]]; then
    printf '%s: %s %s lacks what third_party/%s.patch drops (made against %s %s):\n' \
      "$ME" "$name" "$VERSION" "$name" "$name" "$base_version" >&2
    printf '  %s\n' "${missing[@]}" >&2
    die "update the patch's drop list for $name $VERSION (then its diff: see docs/UPSTREAM.md, 'A new candle version')"
  fi
}

# apply_patch NAME DIR: third_party/NAME.patch applied to DIR, exactly (git apply: no fuzz; every file checked first,
# nothing changed if one hunk fails).
apply_patch() {
  local name=$1 dir=$2 patch="$ROOT/third_party/$1.patch" err base_version
  # GIT_CEILING_DIRECTORIES: never mistake a repository around the temp dir for the one to patch
  if ! err="$(cd "$dir" && GIT_CEILING_DIRECTORIES="$(dirname "$dir")" \
    git -c core.autocrlf=false apply --whitespace=nowarn <"$patch" 2>&1)"; then
    base_version="$(awk -v n="$name" '$1 == "base:" && $2 == n { print $3; exit }' "$patch")"
    {
      echo "$ME: third_party/$name.patch (made against $name $base_version) does not apply to $name $VERSION."
      echo "Files that failed:"
      sed -n -e 's/^error: \(.*\): patch does not apply$/  \1/p' \
        -e 's/^error: \(.*\): No such file or directory$/  \1 (not in the package)/p' \
        -e 's/^error: \(.*\): already exists in working directory$/  \1 (already in the package)/p' <<<"$err" | sort -u
      echo "git apply said:"
      sed 's/^/  | /' <<<"$err"
      echo "To move to $name $VERSION: docs/UPSTREAM.md, 'A new candle version'."
    } >&2
    exit 1
  fi
}

# build NAME DEST: published + patch in DEST.
build() {
  unpack "$1" "$2"
  apply_patch "$1" "$2"
}

# check NAME: sets status=1 if third_party/NAME is not published + patch.
check() {
  local name=$1 want="$TMP/out/$1" have="$ROOT/third_party/$1"
  build "$name" "$want"
  [[ -d $have ]] || die "third_party/$name does not exist; write it with: $ME $VERSION"
  if diff -r "$want" "$have" >"$TMP/diff-$name" 2>&1; then
    echo "$ME: third_party/$name = $name $VERSION + third_party/$name.patch" >&2
    return 0
  fi
  {
    echo "$ME: third_party/$name differs from $name $VERSION + third_party/$name.patch ('expected'):"
    diff -rq "$want" "$have" 2>&1 | sed "s#$want#expected#g; s#$ROOT/##g; s/^/  /" || true
    echo "First lines of the differences:"
    sed "s#$want#expected#g; s#$ROOT/##g; s/^/  | /" "$TMP/diff-$name" | head -n 40 || true
    echo "If third_party/$name was edited on purpose, record the edit in the patch (and say why in"
    echo "docs/UPSTREAM.md): $ME $VERSION --write-patch. To drop an uncommitted edit instead: git checkout"
    echo "(and delete what it added); a committed one: $ME $VERSION rewrites third_party/$name from the patch."
  } >&2
  status=1
}

write() {
  local name=$1 dest="$OUT/$1"
  build "$name" "$TMP/out/$name"
  if [[ -d $dest ]] && diff -r "$TMP/out/$name" "$dest" >/dev/null 2>&1; then
    echo "$ME: ${dest#"$ROOT"/} is already $name $VERSION + third_party/$name.patch" >&2
    return
  fi
  if [[ $OUT == "$ROOT/third_party" ]] &&
    [[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=all -- "third_party/$name")" ]]; then
    die "third_party/$name has uncommitted changes that writing it would lose: commit them, or record them" \
      "with $ME $VERSION --write-patch"
  fi
  rm -rf "$dest"
  mv "$TMP/out/$name" "$dest"
  echo "$ME: wrote ${dest#"$ROOT"/} = $name $VERSION + third_party/$name.patch" >&2
}

write_patch() {
  local name=$1 patch="$ROOT/third_party/$1.patch" work="$TMP/wp-$1" rc=0 sum
  [[ -d $ROOT/third_party/$name ]] || die "third_party/$name does not exist"
  unpack "$name" "$work/a"
  cp -R "$ROOT/third_party/$name" "$work/b"
  # a/ and b/ are the diff's path prefixes, so the patch applies with git apply's default -p1
  (cd "$work" && GIT_CEILING_DIRECTORIES="$work" git -c core.quotepath=false diff --no-index --no-prefix \
    --no-color --no-ext-diff --no-textconv --no-renames --binary a b >"$work/diff") || rc=$?
  [[ $rc -le 1 ]] || die "git diff failed for $name"
  sum="$(sha256 "$(fetch "$name")")"
  {
    header "$patch" | sed "s/^base: $name .*/base: $name $VERSION sha256:$sum/"
    # an added (deleted) file's header names b/ (a/) twice; write it the usual way
    sed 's#^diff --git b/\(.*\) b/\1$#diff --git a/\1 b/\1#; s#^diff --git a/\(.*\) a/\1$#diff --git a/\1 b/\1#' "$work/diff"
  } >"$patch.tmp"
  mv "$patch.tmp" "$patch"
  echo "$ME: wrote third_party/$name.patch ($(grep -c '^diff --git ' "$patch") files, $(wc -c <"$patch") bytes)" >&2
  check "$name" # the new patch reproduces the copy
}

status=0
for name in "${CRATES[@]}"; do
  case $MODE in
    check) check "$name" ;;
    write) write "$name" ;;
    write-patch) write_patch "$name" ;;
  esac
done
exit $status
