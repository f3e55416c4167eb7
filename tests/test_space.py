"""The Hugging Face Space's configuration (docs/space.md): README's YAML front matter, which the Space reads, is the
one source of truth and SPACE.md's copy matches it; the values are ones a Docker Space accepts and agree with the
Dockerfile; the Dockerfile still builds the public Space as before (its build arguments' defaults). Text checks
only: building the image is ``make image-smoke`` (minutes; not in CI)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}  # Spaces' card colours


def readme_front_matter() -> str:
    """The block between README's first two ``---`` lines (the file must start with it)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "---", "README.md must start with the Space's YAML front matter"
    end = lines.index("---", 1)
    return "\n".join(lines[1:end])


def space_md_front_matter() -> str:
    """The ```yaml block of SPACE.md, without its ``---`` fences."""
    text = (ROOT / "SPACE.md").read_text(encoding="utf-8")
    m = re.search(r"```yaml\n---\n(.*?)\n---\n```", text, re.S)
    assert m, "SPACE.md must quote the front matter in a ```yaml block between --- lines"
    return m.group(1)


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text(encoding="utf-8")


def test_readme_front_matter_and_space_md_are_the_same():
    readme, space = readme_front_matter(), space_md_front_matter()
    assert yaml.safe_load(readme) == yaml.safe_load(space)
    assert readme.strip() == space.strip(), "same keys in the same order, no comments: SPACE.md is a copy"


def test_front_matter_is_a_docker_space_that_matches_the_image():
    fm = yaml.safe_load(readme_front_matter())
    assert fm["sdk"] == "docker" and fm["title"] and fm["emoji"]
    assert fm["colorFrom"] in COLOURS and fm["colorTo"] in COLOURS, (fm["colorFrom"], fm["colorTo"])
    assert 0 < len(fm["short_description"]) <= 60  # the Hub's limit
    df = dockerfile()
    assert f"EXPOSE {fm['app_port']}" in df and f"PORT={fm['app_port']}" in df
    if fm.get("hf_oauth"):  # "Sign in with Hugging Face" needs authlib in the image
        assert re.search(r"^authlib==", (ROOT / "requirements.txt").read_text(), re.M)


def test_dockerfile_defaults_build_the_public_space():
    df = dockerfile()
    first_from = re.search(r"^FROM (.+)$", df, re.M).group(1)
    assert first_from == "${BASE_IMAGE}"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", df, re.M), "the Space's base stays the public one"
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", df, re.M)
    assert re.search(r"^ARG TORCH_FIND_LINKS=$", df, re.M), "a local wheel source is opt-in"
    torch_pin = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert df.count(f"torch=={torch_pin}") == 2, "the image installs the torch that requirements.txt pins"
    assert "USER user" in df and "useradd -m -u 1000 user" in df  # Spaces run the container as uid 1000
    assert "/data/pema-studio" in df and "chown user /data-cache /data" in df


def test_docs_name_the_gpu_build_argument_the_dockerfile_names():
    """The exact CUDA value in the Dockerfile's comment is the one docs/gpu.md and docs/space.md give."""
    m = re.search(r"TORCH_INDEX_URL=(https://\S+?)\s", dockerfile().split("ARG TORCH_INDEX_URL=")[0])
    assert m, "the Dockerfile names the GPU build's TORCH_INDEX_URL value in its comment"
    for doc in ("docs/gpu.md", "docs/space.md"):
        assert f"TORCH_INDEX_URL={m.group(1)}" in (ROOT / doc).read_text(encoding="utf-8"), doc
