#!/usr/bin/env bash
# Idempotent set-up for a fresh machine of the project's kind (Debian, Python 3.11, CPU only):
# Debian's Fashion-MNIST, Chromium and ChromeDriver packages, a virtual environment in .venv,
# torch pinned to the local CPU build through constraints.txt, and the project with its dev
# extras. Never downloads CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KAISA_VENV:-.venv}
PY=${PYTHON:-python3}

# Debian's packages: the data (Fashion-MNIST; fortunes, the text corpus of the language-model
# workload), and the browser and its driver for the dashboard's test.
DEBS="dataset-fashion-mnist fortunes chromium chromium-driver"
missing=""
for deb in $DEBS; do
    dpkg -s "$deb" >/dev/null 2>&1 || missing="$missing $deb"
done
if [ -n "$missing" ]; then
    echo "setup: installing Debian's$missing"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

stamp="$VENV/.kaisa-setup-stamp"
# The checkout's own path is part of the stamp: the editable install points at one checkout,
# so a venv reached from another one (a symlink, a copied tree) is installed again.
want="$( (cat pyproject.toml constraints.txt; pwd -P) | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, from the local CPU build, so nothing later can pull a CUDA build.
"$VENV/bin/python" -m pip install -q -c constraints.txt torch==2.13.0
"$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[dev]"
if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qi nvidia; then
    echo "setup: CUDA packages were installed; check constraints.txt" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "setup: environment ready in $VENV"
