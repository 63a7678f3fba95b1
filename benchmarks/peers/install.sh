#!/usr/bin/env bash
# Make the isolated venv that benchmarks/bench_peers.py runs the peers in.
#
#   bash benchmarks/peers/install.sh            # venv at benchmarks/.peers-venv
#   PEERS_VENV=/elsewhere bash benchmarks/peers/install.sh
#   SKIP_APT=1 bash benchmarks/peers/install.sh # system packages already there
#
# The peers get a venv of their own because they pin other numpy/numba/opencv
# releases than lmdbfolder's development venv. torch 2.14.1 + torchvision 0.29.1
# are pinned for every step (constraints.txt): on this kind of machine they
# install from local files for Python 3.11, any other release is a download of
# several GB. About 6 GB of disk in all.
#
# Each peer is installed on its own, then imported; a peer that fails does not
# stop the others. The outcome (version, or the error's last lines) is written to
# $PEERS_VENV/peers-install.json, which bench_peers.py reads to report a peer
# that is not installed as "not installed: <reason>".
#
# System packages (Debian 12, as root): the FFCV build needs libturbojpeg0-dev,
# libopencv-dev and pkg-config; SPDL loads FFmpeg's shared libraries at run time
# (libavdevice59 and friends: FFmpeg 5.1, which spdl's wheel supports); the
# photo-like benchmark tree is made from the photographs in mate-backgrounds,
# plasma-workspace-wallpapers and lomiri-wallpapers-20.04 (about 150 MB).
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${PEERS_VENV:-$repo/benchmarks/.peers-venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
logdir="$venv/install-logs"

if [ "${SKIP_APT:-0}" != 1 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
        libturbojpeg0-dev libopencv-dev pkg-config \
        libavdevice59 libavfilter8 libavformat59 libavcodec59 libswscale6 \
        mate-backgrounds plasma-workspace-wallpapers lomiri-wallpapers-20.04 \
        || echo "warning: apt-get install failed; FFCV will not build, SPDL cannot decode, the photo-like tree cannot be made" >&2
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || exit 1
mkdir -p "$logdir"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -c "$here/constraints.txt")

results=()
# step NAME "IMPORT-CHECK" PACKAGE...
step() {
    local name="$1" check="$2"
    shift 2
    local log="$logdir/$name.log"
    echo "== $name: pip install $*"
    if "${pip[@]}" "$@" >"$log" 2>&1 && "$venv/bin/python" -c "$check" >>"$log" 2>&1; then
        local version
        version="$("$venv/bin/python" -c "$check" 2>/dev/null | tail -1)"
        echo "   ok: $version"
        results+=("$name" "ok" "$version")
    else
        echo "   FAILED (see $log):"
        tail -5 "$log" | sed 's/^/   | /'
        results+=("$name" "failed" "$(grep -E 'Error|error:|ERROR' "$log" | tail -3 | tr '\n' ' ' | cut -c1-600)")
    fi
}

step base "import torch, torchvision, lmdb, PIL; print(f'torch {torch.__version__} torchvision {torchvision.__version__} lmdb {lmdb.__version__} pillow {PIL.__version__}')" \
    torch==2.14.1 torchvision==0.29.1 lmdb pillow numpy
# lmdbfolder itself, from this checkout, without touching the pins above.
step lmdbfolder "import lmdbfolder; print('lmdbfolder', lmdbfolder.__version__)" --no-deps -e "$repo"
step ffcv "import ffcv, numba, numpy; from ffcv.loader import Loader; from importlib.metadata import version; print(f'ffcv {version(\"ffcv\")} numba {numba.__version__} numpy {numpy.__version__}')" \
    ffcv numba
step dali "import nvidia.dali as d; print('nvidia-dali', d.__version__)" nvidia-dali-cuda120
step spdl "import spdl.io, spdl.pipeline; from importlib.metadata import version; print('spdl', version('spdl'))" spdl
step litdata "import litdata; print('litdata', litdata.__version__)" litdata
step webdataset "import webdataset; from importlib.metadata import version; print('webdataset', version('webdataset'))" webdataset

"$venv/bin/python" - "$venv/peers-install.json" "${results[@]}" <<'EOF'
import json, sys
out, rest = sys.argv[1], sys.argv[2:]
report = {rest[i]: {"status": rest[i + 1], "detail": rest[i + 2]} for i in range(0, len(rest), 3)}
with open(out, "w") as f:
    json.dump(report, f, indent=2)
print(f"wrote {out}")
EOF
