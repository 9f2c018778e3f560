"""scripts/gpu_bundle.py: what the Ray Serve bundle for the GPU machine keeps, drops and holds the image to,
on a hand-made install tree (the real bundle's own check, a clean Python 3.12 running Ray from it,
is `bash scripts/gpu_serve_bundle.sh --check`: not in CI, it downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import gpu_bundle


def _dist(site, name, version, requires=(), files=()):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    rows = []
    for rel in files:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x" * 10)
        rows.append(f"{rel},,")
    rows += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def test_prune_keeps_what_the_image_lacks_and_records_what_it_must_have(tmp_path):
    site = tmp_path / "site"
    _dist(site, "ray", "2.60.0", ["aiohttp>=3.7", "numpy>=1.20", "fastapi; extra == 'serve'", "pywin32; sys_platform == 'win32'"],
          ["ray/__init__.py", "ray/jars/a.jar", "ray/rllib/x.py", "ray/serve/tests/t.py", "ray/serve/api.py"])  # fmt: skip
    _dist(site, "fastapi", "0.165.0", ["starlette>=0.40"], ["fastapi/__init__.py"])
    _dist(site, "numpy", "2.5.5", [], ["numpy/__init__.py", "numpy.libs/libx.so"])
    _dist(site, "aiohttp", "3.14.5", [], ["aiohttp/__init__.py"])
    _dist(site, "protobuf", "7.36.2", [], ["google/protobuf/__init__.py"])
    _dist(site, "virtualenv", "21.0", [], ["virtualenv/__init__.py"])
    manifest = gpu_bundle.prune(site)
    assert set(manifest["kept"]) == {"ray", "fastapi", "protobuf"}  # protobuf: an override
    assert set(manifest["removed"]) == {"numpy", "aiohttp", "virtualenv"}
    assert not (site / "numpy").exists() and not (site / "numpy.libs").exists() and not (site / "aiohttp").exists()
    assert (
        not (site / "ray/jars").exists()
        and not (site / "ray/rllib").exists()
        and not (site / "ray/serve/tests").exists()
    )
    assert (site / "ray/serve/api.py").exists() and (site / "google/protobuf/__init__.py").exists()
    image = manifest["left_to_image"]
    assert image["aiohttp"] == [">=3.7"] and image["numpy"] == [">=1.20"] and image["grpcio"] == [">=1.85.1"]
    assert "starlette" not in image and "pywin32" not in image  # not the image's; not on Linux
    assert json.loads((site / "manifest.json").read_text()) == manifest
    assert not set(manifest["kept"]) & (gpu_bundle.IMAGE_PACKAGES - gpu_bundle.OVERRIDES)


def test_unmet_names_what_the_image_lacks_or_has_too_old():
    image = {"aiohttp": [">=3.7"], "grpcio": [">=1.85.1"], "psutil": []}
    assert gpu_bundle.unmet(image, {"aiohttp": "3.14.5", "grpcio": "1.85.3", "psutil": "7.0"}) == []
    lines = gpu_bundle.unmet(image, {"aiohttp": "3.6.0", "grpcio": "1.80.0", "psutil": None})
    assert lines == ["aiohttp 3.6.0: the bundle needs >=3.7", "grpcio 1.80.0: the bundle needs >=1.85.1",
                     "psutil: not installed (the bundle needs any version)"]  # fmt: skip


def test_the_bundle_built_here_fits_a_device_call_and_duplicates_nothing_the_image_has():
    """The manifest of the last build (gpu_bundle/, git-ignored): skipped where none was built."""
    path = Path(__file__).resolve().parents[2] / "gpu_bundle/dist/manifest.json"
    if not path.exists():
        pytest.skip("no bundle built here: bash scripts/gpu_serve_bundle.sh")
    manifest = json.loads(path.read_text())
    assert {"ray", "pydantic", "fastapi", "starlette", "uvicorn"} <= set(manifest["kept"])
    assert not set(manifest["kept"]) & (gpu_bundle.IMAGE_PACKAGES - gpu_bundle.OVERRIDES)
    packed = sum(p.stat().st_size for p in path.parent.glob("serve-bundle.tar.xz*"))
    assert 0 < packed < 24 << 20
