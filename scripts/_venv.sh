# Sourced by the set-up scripts: use the active virtualenv, or create/activate ./.venv (POLYKV_VENV overrides).
set -euo pipefail
if [ -z "${VIRTUAL_ENV:-}" ]; then
    venv="${POLYKV_VENV:-$(pwd)/.venv}"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
fi
python -m pip install -q --disable-pip-version-check --upgrade pip
if ! command -v ccache >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[polykv-cpp] installing ccache (Debian package) so rebuilds are fast"
    (apt-get install -y -qq ccache >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq ccache >/dev/null 2>&1)) || true
fi
