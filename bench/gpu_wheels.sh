#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh needs on the GPU machine and that machine lacks: the pure and
# binary wheels of Beam, pandera, polars and pydantic (and their missing dependencies), for
# CPython 3.12 on x86-64, unpacked into one folder and packed as .whl/site.tar.xz (xz packs the
# wheels' 86 MB into about 50 MB: the device call carries at most 64 MiB with the working tree).
# Tests and examples inside Beam are left out. MLflow is not carried: a run whose tracking
# store cannot be reached still commits and keeps its metrics in _metrics.json.
#
#   bench/gpu_wheels.sh            # writes .whl/site.tar.xz (ignored by git; carry it)
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=(
  apache-beam==2.77.0 pandera==0.35.0 polars==2.1.0 polars-runtime-32==2.1.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typeguard==4.6.1 fastavro==1.13.1 fasteners==0.20 httplib2==0.32.1 jsonpickle==4.1.4
  objsize==0.8.0 proto-plus==1.29.0 zstandard==0.25.0 beartype==0.22.9 pytz==2026.6
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/wheels" "${PINS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do
  python3 -m zipfile -e "$wheel" "$work/site"
done
find "$work/site/apache_beam" \( -name '*_test.py' -o -name '*_it_test.py' -o -name 'testdata' \) -prune \
  -exec rm -rf {} +
rm -rf "$work/site/apache_beam/examples"
mkdir -p .whl
tar -C "$work/site" -cf - . | xz -T0 -6 > .whl/site.tar.xz
echo "$(du -h .whl/site.tar.xz | cut -f1) in .whl/site.tar.xz ($(ls "$work"/wheels | wc -l) wheels)"
