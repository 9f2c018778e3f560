"""deployments/serving/recipe.py's `weights`: a Serve config's models put on a node (the Hugging
Face ids downloaded into the cache, local paths checked, a missing one a one-line error naming
it), without a hub: the download is a recorder."""

from __future__ import annotations

import yaml

from deployments.serving import recipe


def _config(small: str, large: str, medium: list[str] | None = None) -> dict:
    return {
        "applications": [
            {
                "name": "backoff",
                "args": {"models": {"small": small, "large": large, **({"medium": medium} if medium else {})}},
            }
        ]
    }


def test_models_of_lists_each_model_once_smallest_first():
    assert recipe.models_of(_config("org/s", "org/l", ["org/m"])) == ["org/s", "org/m", "org/l"]
    assert recipe.models_of(_config("org/s", "org/s")) == ["org/s"]
    assert recipe.models_of({"applications": [{"name": "backoff", "args": {}}]}) == []  # the embedded pair


def test_fetch_downloads_ids_and_keeps_local_paths(tmp_path):
    asked = []

    def download(repo_id: str, ignore_patterns: list[str]) -> str:
        asked.append((repo_id, ignore_patterns))
        return f"/cache/{repo_id}"

    local = tmp_path / "m-s"
    local.mkdir()
    assert recipe.fetch([str(local), "org/m-l"], download) == [str(local), "/cache/org/m-l"]
    assert asked == [("org/m-l", recipe.SKIP)]


def test_weights_names_a_local_model_missing_on_this_node(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_config(str(tmp_path / "nowhere"), str(tmp_path))))
    assert recipe.main(["weights", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "every node" in err
    (tmp_path / "nowhere").mkdir()
    assert recipe.main(["weights", str(path)]) == 0
    assert recipe.main(["weights", "--model", "no spaces/in ids"]) == 2
