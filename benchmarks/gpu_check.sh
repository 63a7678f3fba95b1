#!/usr/bin/env bash
# One-shot check of the GPU batch path (lmdbfolder.gpu, issue 13) on a machine with an NVIDIA GPU.
#
#   bash benchmarks/gpu_check.sh                 # install, GPU tests, photo-like tree, bench: ~3-6 minutes
#   bash benchmarks/gpu_check.sh --fetch-wheels  # on a machine with PyPI: fetch the wheels an offline one needs
#
# For an offline GPU machine, prepare on this one and send both folders along (they are git-ignored):
#   bash benchmarks/gpu_check.sh --fetch-wheels            # .whl/: lmdb and simplejpeg wheels (~1 MB)
#   python benchmarks/photolike.py sources .photos         # .photos/: the 24 source photographs (~17 MB)
#
# Steps (each under its own time limit; the script goes on after a failed step and exits non-zero at the end):
#   1. env.txt      nvidia-smi, Python and library versions
#   2. install.log  a virtual environment from the project's own files. If this machine's python3 already has
#                   a CUDA build of torch, the venv sees that interpreter's packages (no GBs of torch to fetch)
#                   and installs only the requirements-test.txt pins it lacks (lmdb, simplejpeg, ...), from
#                   $WHEELS when that folder exists (offline machines), then `pip install -e .`. Otherwise it
#                   installs requirements-test.txt as pinned (torch from PyPI) and the project.
#   3. tests.log    pytest -m cuda tests/test_gpu.py (device transfer, bit-exact resize on CUDA, pixel tolerance
#                   against the CPU path, fallbacks, pinned DataLoader), then the CPU tests of the same file
#   4. photolike.txt  a photo-like tree of $IMAGES ImageNet-shaped JPEGs (benchmarks/photolike.py), packed
#   5. bench.txt, bench.png  `lmdbfolder bench --device $DEVICE`: ImageFolder, LMDBFolder default and fastest
#                   (the CPU fast path) against the GPU path, warm, for $WORKERS DataLoader workers
#   6. summary.txt  the lines to read first
# Outputs go to $OUT if it is set, else benchmarks/results/gpu-check/. Scratch data: $WORK (default /tmp/...).
# Settings (environment): IMAGES (4000), DEVICE (cuda), BATCH (256), WORKERS ("<cpus/2> <cpus>"),
# PYTHON (python3), WHEELS (.whl), WORK, REPEAT (2), REUSE_TORCH (auto: reuse python3's torch when it sees a GPU;
# 1: always, e.g. to try the script on a CPU-only machine with DEVICE=cpu; 0: never).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
# The pins an offline machine with its own CUDA torch may lack (requirements-test.txt gives the versions).
OFFLINE_PINS="lmdb simplejpeg tqdm numpy pillow pytest pytest-timeout"

if [ "${1:-}" = "--fetch-wheels" ]; then
    # Wheels for a Python 3.12 x86-64 Linux machine without network access (change with WHEEL_PYTHON).
    mkdir -p "$WHEELS"
    for name in lmdb simplejpeg; do
        pin=$(grep -iE "^$name==" requirements-test.txt) || { echo "no pin for $name in requirements-test.txt"; exit 1; }
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$WHEELS" "$pin" || exit 1
    done
    ls -l "$WHEELS"
    echo "copy $WHEELS next to the checkout on the GPU machine (it is not tracked by git)"
    exit 0
fi

OUT_DIR=${OUT:-$ROOT/benchmarks/results/gpu-check}
WORK=${WORK:-${TMPDIR:-/tmp}/lmdbfolder-gpu-check}
IMAGES=${IMAGES:-4000}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-256}
REPEAT=${REPEAT:-2}
CPUS=$(nproc 2>/dev/null || echo 2)
WORKERS=${WORKERS:-"$((CPUS / 2 > 0 ? CPUS / 2 : 1)) $CPUS"}
VENV=$WORK/venv
VPY=$VENV/bin/python
mkdir -p "$OUT_DIR" "$WORK"
: >"$OUT_DIR/summary.txt"
export PYTHONUNBUFFERED=1
FAILED=""

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT_DIR/summary.txt"; }
step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, log to LOG, remember failures
    local name=$1 limit=$2 log=$3
    shift 3
    say "$name: $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ]; then
        FAILED="$FAILED $name"
        say "$name failed (exit $rc$([ "$rc" = 124 ] && echo ", over its ${limit} s"))"
    fi
    return "$rc"
}

# -- 1. environment ----------------------------------------------------------------------------------
{
    date
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    echo "cpus: $CPUS"
    "$PY" -c 'import sys, torch, torchvision; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("torchvision", torchvision.__version__); print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
} >"$OUT_DIR/env.txt"
say "environment: $(grep -E '^(torch|gpu) ' "$OUT_DIR/env.txt" | tr '\n' ';')"

# -- 2. install ----------------------------------------------------------------------------------------
install() {
    if [ -x "$VPY" ] && "$VPY" -c 'import lmdbfolder.gpu' 2>/dev/null; then
        echo "reusing $VENV"
        return 0
    fi
    local find=()
    if [ -d "$WHEELS" ]; then find=(--no-index --find-links "$WHEELS"); fi
    local reuse=${REUSE_TORCH:-auto}
    if [ "$reuse" = auto ]; then
        "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && reuse=1 || reuse=0
    fi
    if [ "$reuse" = 1 ]; then
        # Keep this machine's CUDA torch: let the venv see the interpreter's packages through a .pth file
        # (--system-site-packages would show the base installation's, not those of a venv python3 runs in),
        # pip and setuptools included (the venv's own bundled ones can be older than pyproject.toml needs).
        "$PY" -m venv --without-pip "$VENV" || return 1
        "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
            >"$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_machine_packages.pth"
        local missing=()
        for name in $OFFLINE_PINS; do
            module=$(case $name in pillow) echo PIL ;; pytest-timeout) echo pytest_timeout ;; *) echo "$name" ;; esac)
            if ! "$VPY" -c "import $module" 2>/dev/null; then
                missing+=("$(grep -iE "^$name==" requirements-test.txt)")
            fi
        done
        echo "machine torch kept; installing: ${missing[*]:-nothing}"
        if [ ${#missing[@]} -gt 0 ]; then
            "$VPY" -m pip install --quiet --disable-pip-version-check "${find[@]}" "${missing[@]}" || return 1
        fi
        "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation "${find[@]}" -e . ||
            return 1
    else
        "$PY" -m venv "$VENV" || return 1
        "$VPY" -m pip install --quiet --disable-pip-version-check "${find[@]}" -r requirements-test.txt || return 1
        "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . || return 1
    fi
    (cd / && "$VPY" -c 'import lmdbfolder.gpu, torch; print("installed", lmdbfolder.gpu.__file__, "; torch", torch.__version__)')
}
export -f install
export VPY VENV PY WHEELS OFFLINE_PINS REUSE_TORCH=${REUSE_TORCH:-auto}
step install 300 "$OUT_DIR/install.log" bash -c install || {
    say "cannot go on without the environment; see install.log"
    exit 1
}

# -- 3. tests --------------------------------------------------------------------------------------------
step gpu-tests 240 "$OUT_DIR/tests.log" "$VPY" -m pytest -p no:cacheprovider -q -rA -s -m cuda tests/test_gpu.py
step cpu-tests 240 "$OUT_DIR/tests.log" "$VPY" -m pytest -p no:cacheprovider -q -m "not cuda" tests/test_gpu.py
grep -E "GPU vs CPU path|GPU fallbacks|GPU ms per batch|passed|failed|skipped" "$OUT_DIR/tests.log" | tee -a "$OUT_DIR/summary.txt"

# -- 4. photo-like data ------------------------------------------------------------------------------------
TREE=$WORK/photolike-$IMAGES
PACK=$WORK/photolike-$IMAGES.lmdb
# The source photos: the Debian wallpaper packages where installed, else the copies in .photos/
# (made beforehand with `python benchmarks/photolike.py sources .photos` and sent along).
if [ -z "${PHOTOLIKE_SOURCES:-}" ] && [ -d "$ROOT/.photos" ]; then export PHOTOLIKE_SOURCES="$ROOT/.photos"; fi
step data 240 "$OUT_DIR/photolike.txt" "$VPY" benchmarks/photolike.py make "$TREE" --images "$IMAGES" --classes 100
if [ ! -d "$PACK" ]; then
    step pack 240 "$OUT_DIR/photolike.txt" "$VPY" -m lmdbfolder pack "$TREE" "$PACK" --no-progress
fi

# -- 5. bench ------------------------------------------------------------------------------------------------
# shellcheck disable=SC2086  # WORKERS is a list of counts
step bench 420 "$OUT_DIR/bench.txt" "$VPY" -m lmdbfolder bench "$TREE" "$PACK" --device "$DEVICE" \
    --workers $WORKERS --warm-only --repeat "$REPEAT" --limit 0 --batch-size "$BATCH" --chart "$OUT_DIR/bench.png"

# -- 6. summary ------------------------------------------------------------------------------------------------
grep -E "^(train pipeline, warm|decode\+augment, warm) .*(LMDBFolder fastest|GPU path)|GPU path|samples by path" \
    "$OUT_DIR/bench.txt" | tee -a "$OUT_DIR/summary.txt"
if [ -n "$FAILED" ]; then
    say "failed steps:$FAILED"
    exit 1
fi
say "all steps passed; outputs in $OUT_DIR"
