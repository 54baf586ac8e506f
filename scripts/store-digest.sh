#!/usr/bin/env bash
# One digest of everything under src/computepool/store (the models, queries and migrations): when it
# differs from .ci/store-digest, CI runs every server test on both databases.
set -euo pipefail
cd "$(dirname "$0")/.."
find src/computepool/store -name '*.py' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
