#!/usr/bin/env bash
# Ray Serve for the GPU machine (docs/gpu.md, "The served path"): its image has Python 3.12,
# torch and transformers but no Ray, pydantic or fastapi, and no network. Here, where pip
# reaches the package index:
#
#   bash scripts/gpu_serve_bundle.sh            # gpu_bundle/serve-bundle.tar.xz (+ .part1 ... if split)
#   bash scripts/gpu_serve_bundle.sh --check    # the same, then a clean Python 3.12 venv of the image's
#                                               # packages runs the bundle: its imports, a local Ray and a
#                                               # Serve app answering over HTTP (~1 min; not in CI)
#
# 1. pip downloads REQUIREMENTS (ray[serve] at the version the project runs, pydantic, fastapi,
#    uvicorn, grpcio, protobuf ...) for CPython 3.12 manylinux x86_64 into gpu_bundle/wheels
#    (kept: a second build fetches nothing), and installs them into gpu_bundle/site;
# 2. scripts/gpu_bundle.py prune drops what the image has (its package list; protobuf stays: the
#    generated gRPC code needs its version; grpcio is left to the image, which must have 1.85.1 for
#    gRPC: `check` says so, and the served stage then runs HTTP alone), Java, rllib/tune/train/data/llm, the
#    dashboard's web client and every tests folder, strips the native binaries' symbols and writes
#    gpu_bundle/site/manifest.json;
# 3. one xz tarball, split into parts of PART_MIB (default 19: what a device call carries beside the
#    checkout's ~41 MiB and gpu_pair's 3.4, under its 64) where it is larger.
#
# The device call carries `gpu_bundle/dist` (and `gpu_pair`); scripts/gpu_bench.sh served unpacks it
# to /tmp/serve-site and puts that on PYTHONPATH. gpu_bundle/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BUNDLE_DIR:-gpu_bundle}
part_mib=${PART_MIB:-19}
ray_version=$(.venv/bin/python -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)
requirements=("ray[serve]==$ray_version" "pydantic>=2.6" fastapi uvicorn "protobuf>=7.35.1")
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pip's install (not its download) checks each wheel's Requires-Python against the interpreter
# that runs it: a CPython 3.12 installs the tree (pyenv's where there is no python3.12 on PATH)
py312=${PY312:-}
for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do # pyenv's shim fails outside its version
    [ -n "$py312" ] || ! "$candidate" -c "" 2>/dev/null || py312=$candidate
done
[ -n "$py312" ] || { echo "no python3.12 here (PY312=...): the bundle's tree is installed by one" >&2; exit 2; }
mkdir -p "$dir/wheels"
python3 -m pip download -q "${platform[@]}" -d "$dir/wheels" "${requirements[@]}" || {
    echo "pip could not download from the package index: see docs/gpu.md, 'The served path'" >&2
    exit 2
}
rm -rf "$dir/stage" "$dir/dist"
site=$dir/stage/site
"$py312" -m pip install -q --no-index --find-links "$dir/wheels" --no-compile --target "$site" \
    "${requirements[@]}" 2>&1 | { grep -v "^WARNING: " || true; }
python3 scripts/gpu_bundle.py prune "$site"
# the binaries' symbol tables (Ray's _raylet.so, gcs_server, raylet: 117 MiB with them, 84 without)
find "$site" -type f \( -name '*.so*' -o -path '*/core/src/ray/*' \) -exec strip --strip-unneeded {} + 2>/dev/null || true
# the random-weight pair's source rides along (its tokenizer packs from 3.4 MiB to 0.7)
pair_src=${PAIR_SRC:-../shared/gpu}
[ -f "$pair_src/make_pair.py" ] || { echo "no $pair_src/make_pair.py (PAIR_SRC=...)" >&2; exit 2; }
cp -r "$pair_src" "$dir/stage/gpu_pair"
rm -rf "$dir/stage/gpu_pair/__pycache__"
mkdir -p "$dir/dist"
cp "$site/manifest.json" "$dir/dist/"
# Ray's three binaries first and side by side: they link the same libraries, and xz's 64 MiB
# window then packs them together (14 MiB, against 21 apart)
binaries=(site/ray/core/src/ray/gcs/gcs_server site/ray/core/src/ray/raylet/raylet site/ray/_raylet.so)
(printf '%s\n' "${binaries[@]}"; cd "$dir/stage" && find site gpu_pair \( -type f -o -type l \) | sort |
    grep -vxF -f <(printf '%s\n' "${binaries[@]}")) >"$dir/files.txt"
tar -C "$dir/stage" --no-recursion -T "$dir/files.txt" -cf - | xz -9e -T1 >"$dir/dist/serve-bundle.tar.xz"
size=$(stat -c %s "$dir/dist/serve-bundle.tar.xz")
# what a device call carries beside the checkout (its tracked and untracked files), under its 64 MiB
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s}')
room=$(((63 << 20) - tree))
parts=1
if [ "$size" -gt "$room" ]; then # two calls: scripts/gpu_bench.sh served takes the parts one a call
    split -n 2 -d -a 1 "$dir/dist/serve-bundle.tar.xz" "$dir/dist/serve-bundle.tar.xz.part"
    rm "$dir/dist/serve-bundle.tar.xz"
    parts=2
fi
echo "bundle: $(du -sm "$site" | cut -f1) MiB unpacked, $(awk "BEGIN {printf \"%.1f\", $size / 1048576}") MiB packed," \
    "$parts part(s); the checkout's $(awk "BEGIN {printf \"%.1f\", $tree / 1048576}") MiB leave $(awk "BEGIN {printf \"%.1f\", $room / 1048576}") MiB a call"
ls -l "$dir/dist"
[ "${1:-}" = --check ] || exit 0

# a clean CPython 3.12 with the image's packages the bundle leaves to it (manifest: left_to_image),
# the bundle unpacked from its tarball on PYTHONPATH, as on the GPU machine
venv=${CHECK_VENV:-/tmp/serve-bundle-venv}
rm -rf "$venv" /tmp/serve-site-check && "$py312" -m venv "$venv" && mkdir -p /tmp/serve-site-check
mapfile -t image < <("$venv/bin/python" -c "import json; print('\n'.join(json.load(open('$dir/dist/manifest.json'))['left_to_image']))")
python3 -m pip download -q "${platform[@]}" -d "$dir/wheels" "${image[@]}" # what the project imports beside Ray's
"$venv/bin/python" -m pip install -q --no-index --find-links "$dir/wheels" "${image[@]}" 2>&1 | { grep -v "^WARNING" || true; }
cat "$dir"/dist/serve-bundle.tar.xz* | xz -d | tar -C /tmp/serve-site-check -xf -
PYTHONPATH=/tmp/serve-site-check/site "$venv/bin/python" scripts/gpu_bundle.py check /tmp/serve-site-check/site
PYTHONPATH=/tmp/serve-site-check/site RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 timeout 300 "$venv/bin/python" - <<'PY'
import json, urllib.request

import ray
from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {"X": "1"}}})
class Hello:
    def __call__(self, request):
        import os

        return {"hello": os.environ["X"]}


ray.init(address="local", include_dashboard=False, num_cpus=2)
serve.start(http_options={"host": "127.0.0.1", "port": 18765})
serve.run(Hello.bind(), name="hello", route_prefix="/")
print("bundle check:", json.load(urllib.request.urlopen("http://127.0.0.1:18765/")), "from a Serve app on Ray", ray.__version__)
serve.shutdown()
ray.shutdown()
PY
