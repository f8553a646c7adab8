#!/usr/bin/env bash
# Install PyTorch's launcher, torchrun, into a virtual environment at PREFIX, small enough for CI and for
# machines without a GPU, so that tests/stage_comms/comms_torchrun.rs runs harpe under the real torchrun.
#
#   scripts/install-torchrun.sh PREFIX      # prints PREFIX/bin/torchrun on stdout (progress on stderr)
#
# Only PyPI is reachable, and PyPI's Linux torch wheel is the CUDA build: `pip install torch` pulls ~4 GB
# of NVIDIA libraries (cuBLAS, cuDNN, NCCL, ...; measured: 5.3 GB installed, 2 min 48 s). torchrun never
# touches CUDA, but `import torch` loads libtorch_cuda.so, which links those libraries. So:
#   1. python3 -m venv PREFIX; pip install torch==$TORCH_V --no-deps (the 540 MB wheel), plus the small
#      pure-Python packages `import torch` needs (typing-extensions, filelock, sympy, networkx, jinja2,
#      fsspec);
#   2. for each CUDA library the torch libraries link but that is absent (ldd: "not found"), build a stub
#      shared library with that soname in site-packages/nvidia/cu13/lib (on torch's RPATH): one
#      function per symbol torch imports from it, returning an error code, under the symbol versions
#      torch asks for (read with nm/readelf from torch's own libraries). Nothing calls them on a CPU
#      run; torch.cuda.is_available() is False;
#   3. checks that `torchrun --help` runs and that a TCPStore answers, then stamps PREFIX.
# Measured on this 2-core machine: 1.3 GB installed (vs 5.3 GB for the full CUDA install), 33 s of CPU;
# wall time 2 min 47 s to 5 min 44 s depending on the machine's load (download and unpacking dominate).
# A second call with the stamp present costs nothing. Needs python3 (with venv), gcc, nm, readelf, ldd.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX   (prints the torchrun path)" >&2
  exit 2
fi
TORCH_V=2.15.0
PREFIX="$1"
log() { echo "[install-torchrun] $*" >&2; }
STAMP="$PREFIX/.harpe-torch-$TORCH_V"
if [ -f "$STAMP" ]; then
  log "reusing $PREFIX"
  echo "$PREFIX/bin/torchrun"
  exit 0
fi
for tool in python3 gcc nm readelf ldd; do
  command -v "$tool" >/dev/null || { log "error: $tool not found; hint: apt-get install python3-venv gcc binutils"; exit 1; }
done
rm -rf "$PREFIX"
python3 -m venv "$PREFIX"
PY="$PREFIX/bin/python"
log "pip install torch==$TORCH_V --no-deps (540 MB wheel)"
"$PY" -m pip install --quiet --no-cache-dir --no-deps "torch==$TORCH_V" >&2
"$PY" -m pip install --quiet --no-cache-dir typing-extensions filelock sympy networkx jinja2 fsspec >&2

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUBS="$SITE/nvidia/cu13/lib"
mkdir -p "$STUBS"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
log "building stubs of the CUDA libraries torch links"
python3 - "$SITE/torch" "$WORK" >&2 <<'EOF'
import glob, os, re, subprocess, sys

torch_dir, work = sys.argv[1], sys.argv[2]
libs = glob.glob(os.path.join(torch_dir, "lib", "*.so*")) + glob.glob(os.path.join(torch_dir, "_C*.so"))
run = lambda *a: subprocess.run(a, capture_output=True, text=True).stdout

missing = set()  # sonames torch links that are not there
for lib in libs:
    for line in run("ldd", lib).splitlines():
        m = re.match(r"\s*(\S+) => not found", line)
        if m:
            missing.add(m.group(1))

ver_file = {}  # symbol version name -> soname that must define it (readelf -V, "Version needs")
for lib in libs:
    cur = None
    for line in run("readelf", "-V", "-W", lib).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            cur = m.group(1)
        m = re.search(r"Name: (\S+)", line)
        if m and cur:
            ver_file[m.group(1)] = cur

defined = set()
undefined = set()  # (name, version or "")
for lib in libs:
    for line in run("nm", "-D", lib).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            name, _, ver = parts[1].partition("@")
            undefined.add((name, ver.lstrip("@")))
        elif len(parts) == 3:
            defined.add(parts[2].split("@")[0])

cuda_name = re.compile(r"^(cu|nccl|nvrtc|nvshmem|__cuda|__nv)")
unversioned = sorted(n for n, v in undefined if not v and cuda_name.match(n) and n not in defined)
for so in sorted(missing):
    own_versions = sorted({v for n, v in undefined if v and ver_file.get(v) == so})
    own = {v: sorted(n for n, w in undefined if w == v) for v in own_versions}
    names = sorted(set(unversioned) | {n for ns in own.values() for n in ns})
    base = os.path.join(work, so)
    with open(base + ".c", "w") as f:
        f.write("/* stub: torch links this CUDA library; nothing calls it on a CPU-only machine */\n")
        for n in names:
            f.write(f"int {n}(void) {{ return 999; }}\n")
    with open(base + ".map", "w") as f:
        for v, ns in own.items():
            f.write(f"{v} {{ global: {'; '.join(ns)}; }};\n")
        if not own:
            f.write("{ global: *; };\n")
    print(so)
EOF
for c in "$WORK"/*.c; do
  so="$(basename "$c" .c)"
  gcc -shared -fPIC -o "$STUBS/$so" -Wl,-soname,"$so" -Wl,--version-script="$WORK/$so.map" "$c"
done
log "stubs: $(ls "$STUBS" | tr '\n' ' ')"

"$PREFIX/bin/torchrun" --help >/dev/null 2>&1 || { log "error: torchrun --help fails in $PREFIX"; "$PREFIX/bin/torchrun" --help >&2; exit 1; }
"$PY" -c 'from torch.distributed import TCPStore; s = TCPStore("127.0.0.1", 0, 1, True); s.set("k", "v"); assert s.get("k") == b"v"' 2>/dev/null \
  || { log "error: torch's TCPStore does not work in $PREFIX"; exit 1; }
touch "$STAMP"
log "done: $(du -sh "$PREFIX" | cut -f1) in $PREFIX"
echo "$PREFIX/bin/torchrun"
