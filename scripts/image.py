"""Build the Space's Docker image with the project's own Dockerfile and smoke-test the studio served from it
(docs/space.md). Not part of CI: a full build takes many minutes on 2 cores.

    python scripts/image.py base     # a Debian bookworm base image from Debian's packages (debootstrap), no Docker Hub
    python scripts/image.py build    # the image (make image)
    python scripts/image.py smoke    # build, run, check, restart, check, clean up (make image-smoke)

The container engine is podman where it is installed (run with ``--runtime runc --cgroup-manager cgroupfs`` and a
containers.conf without default rlimits, which this sandbox's kernel refuses), else docker (``ENGINE=docker``
chooses it). Environment:

* ``IMAGE`` (default ``pema-studio``): the image's name.
* ``BASE_IMAGE``: the Dockerfile's base. Unset: ``python:3.11-slim`` where it is already in the engine's store,
  else ``localhost/pema-base:bookworm``, made by ``base`` when missing (Docker Hub is out of reach here).
  ``BASE_IMAGE=python:3.11-slim`` pulls the public base like the Space does.
* ``TORCH_INDEX_URL``: passed on to the build (the Dockerfile's default: PyTorch's CPU index).
* ``TORCH_WHEEL``: a local torch 2.13.0 wheel for the build. Unset: a CPU wheel in pip's find-links folders
  (``PIP_FIND_LINKS`` / ``pip config``), if one lies there. The wheel is served to the build on a loopback port
  (``TORCH_FIND_LINKS``, the build runs with ``--network=host``); ``TORCH_WHEEL=none`` uses the index instead.
* ``NO_CACHE=1``: build without the engine's layer cache (the time of a build from nothing).
* ``KEEP=1`` (smoke): leave the container and its volume in place.

The smoke test prints one closing line: image size, build time, first page, first comparison, date and CPU.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import http.server
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = Path(os.environ.get("IMAGE_SCRATCH", "/tmp/pema-image"))
LOCAL_BASE = "localhost/pema-base:bookworm"
PUBLIC_BASE = "python:3.11-slim"
TORCH = "2.13.0"
DEBIAN_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
# A sandbox whose kernel refuses the default rlimits (crun: "setrlimit RLIMIT_NOFILE: Operation not permitted").
CONTAINERS_CONF = """[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
"""


def log(msg: str) -> None:
    print(f"[image] {msg}", flush=True)


# --- the engine -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def engine() -> tuple[list[str], dict]:
    """The engine's command prefix and the environment it runs with."""
    name = os.environ.get("ENGINE") or ("podman" if shutil.which("podman") else "docker")
    if not shutil.which(name):
        raise SystemExit("error: neither podman nor docker is installed (Debian: apt-get install -y podman runc; "
                         "make image-tools does it)")
    env = dict(os.environ)
    cmd = [name]
    if name == "podman":
        if "CONTAINERS_CONF" not in env:
            SCRATCH.mkdir(parents=True, exist_ok=True)
            conf = SCRATCH / "containers.conf"
            conf.write_text(CONTAINERS_CONF)
            env["CONTAINERS_CONF"] = str(conf)
        if shutil.which("runc"):
            cmd += ["--runtime", "runc"]
        cmd += ["--cgroup-manager", "cgroupfs"]
    return cmd, env


def run(*args: str, check: bool = True, capture: bool = False, quiet: bool = False,
        **kw) -> subprocess.CompletedProcess:
    """Run the engine with ``args``."""
    prefix, env = engine()
    if not quiet:
        log("$ " + " ".join([Path(prefix[0]).name, *args]))
    return subprocess.run([*prefix, *args], env=env, check=check, text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None, **kw)


def have_image(name: str) -> bool:
    return run("image", "exists" if engine()[0][0].endswith("podman") else "inspect", name, check=False,
               capture=True, quiet=True).returncode == 0


# --- the base image -------------------------------------------------------------------------------------------------
def _host_only_certs(rootfs: Path) -> list[str]:
    """The CA certificates this machine trusts and a fresh Debian does not (an intercepting egress proxy's)."""
    pem = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)
    host = Path("/etc/ssl/certs/ca-certificates.crt")
    if not host.exists():
        return []
    theirs = {c.strip() for c in pem.findall((rootfs / "etc/ssl/certs/ca-certificates.crt").read_text())}
    return [c for c in pem.findall(host.read_text()) if c.strip() not in theirs]


def make_base(force: bool = False) -> str:
    """``localhost/pema-base:bookworm``: Debian bookworm (minbase) with python3.11 in a venv at /opt/python first
    on PATH, the way python:3.11-slim has its python and pip in /usr/local/bin. Made from Debian's packages with
    debootstrap (root), so it needs no container registry."""
    if have_image(LOCAL_BASE) and not force:
        log(f"base image {LOCAL_BASE} is there")
        return LOCAL_BASE
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        raise SystemExit("error: the base image is made with debootstrap as root (apt-get install -y debootstrap), "
                         f"or set BASE_IMAGE to an image you have (e.g. {PUBLIC_BASE})")
    rootfs = SCRATCH / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"debootstrap bookworm → {rootfs} (about a minute)")
    subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                    "bookworm", str(rootfs), DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)
    extra = _host_only_certs(rootfs)
    if extra:  # this machine reaches PyPI through a proxy with its own CA: the build's pip must trust it too
        folder = rootfs / "usr/local/share/ca-certificates"
        folder.mkdir(parents=True, exist_ok=True)
        for i, cert in enumerate(extra):
            (folder / f"build-host-{i}.crt").write_text(cert + "\n")
        subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/python"], check=True)
    (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / junk).glob("*"):
            if p.is_file():
                p.unlink()
    prefix, env = engine()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run([*prefix, "import",
                    "--change", "ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]', "-", LOCAL_BASE],
                   stdin=tar.stdout, env=env, check=True, stdout=subprocess.DEVNULL)
    tar.stdout.close()
    if tar.wait() != 0:
        raise SystemExit("error: tar of the base rootfs failed")
    shutil.rmtree(rootfs)
    log(f"base image {LOCAL_BASE} made in {time.time() - t0:.0f} s")
    return LOCAL_BASE


def base_image() -> str:
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    if have_image(PUBLIC_BASE) or have_image(f"docker.io/library/{PUBLIC_BASE}"):
        return PUBLIC_BASE
    return make_base()


# --- the torch wheel ------------------------------------------------------------------------------------------------
def _find_links_dirs() -> list[Path]:
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "find-links" in line.split("=", 1)[0]:
            found += line.split("=", 1)[1].strip().strip("'\"").split()
    dirs = []
    for f in found:
        p = Path(f.removeprefix("file://"))
        if p.is_dir() and p not in dirs:
            dirs.append(p)
    return dirs


def local_torch_wheel() -> Path | None:
    """A CPU wheel of torch 2.13.0 for the image's Python 3.11 on x86-64 lying on this machine, if any."""
    want = os.environ.get("TORCH_WHEEL", "")
    if want == "none":
        return None
    if want:
        return Path(want)
    for d in _find_links_dirs():
        for w in sorted(d.glob(f"torch-{TORCH}+cpu-cp311-cp311-manylinux*_x86_64.whl")):
            return w
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):  # noqa: D102 — pip's requests are not news
        pass


def serve_folder(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``folder``'s listing and files on 127.0.0.1 (pip's --find-links reads the listing's links)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


# --- build ----------------------------------------------------------------------------------------------------------
def image_name() -> str:
    return os.environ.get("IMAGE", "pema-studio")


def build() -> float:
    """Build the image; the seconds it took."""
    base = base_image()
    args = ["build", "-t", image_name(), "-f", str(ROOT / "Dockerfile"), "--network=host",
            "--build-arg", f"BASE_IMAGE={base}"]
    if os.environ.get("TORCH_INDEX_URL"):
        args += ["--build-arg", f"TORCH_INDEX_URL={os.environ['TORCH_INDEX_URL']}"]
    if os.environ.get("NO_CACHE") == "1":
        args.append("--no-cache")
    srv = None
    wheel = local_torch_wheel()
    if wheel is not None:
        if not wheel.is_file():
            raise SystemExit(f"error: TORCH_WHEEL {wheel} is not a file")
        folder = Path(tempfile.mkdtemp(prefix="wheels-", dir=SCRATCH))
        os.symlink(wheel.resolve(), folder / wheel.name)
        srv, url = serve_folder(folder)
        log(f"torch: {wheel} served to the build at {url}")
        args += ["--build-arg", f"TORCH_FIND_LINKS={url}"]
    t0 = time.time()
    try:
        run(*args, str(ROOT))
    finally:
        if srv is not None:
            srv.shutdown()
            shutil.rmtree(folder, ignore_errors=True)
    took = time.time() - t0
    log(f"built {image_name()} from {base} in {took:.0f} s, {human(image_size())}")
    return took


def image_size() -> int:
    out = run("image", "inspect", "--format", "{{.Size}}", image_name(), capture=True, quiet=True).stdout
    return int(out.strip().splitlines()[0])


def human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


# --- smoke ----------------------------------------------------------------------------------------------------------
PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schläft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt"), ("the dog runs", "der Hund läuft"),
         ("I like tea", "ich mag Tee")] * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> tuple[int, dict, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 — a loopback URL we made
        return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode("utf-8", "replace")


def wait_page(url: str, name: str, timeout: float) -> float:
    """Seconds until ``url`` answers 200 (the container's logs on failure)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if http_get(url, timeout=5)[0] == 200:
                return time.time() - t0
        except OSError:
            pass
        state = run("inspect", "--format", "{{.State.Running}}", name, capture=True, quiet=True).stdout.strip()
        if state != "true":
            run("logs", name, check=False)
            raise SystemExit(f"error: the container {name} stopped before serving {url}")
        time.sleep(0.5)
    run("logs", "--tail", "50", name, check=False)
    raise SystemExit(f"error: {url} did not answer within {timeout:.0f} s")


def owner_key(url: str) -> str:
    """An anonymous owner's key, the way a browser gets one: the pema_owner cookie of the first page (multi-user
    mode); "" in single-user mode."""
    _, headers, _ = http_get(url)
    m = re.search(r"pema_owner=([^;]+)", headers.get("set-cookie", ""))
    return m.group(1) if m else ""


def wait_ready(client, timeout: float) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = client.predict(api_name="/status")
        if st.get("ready") or st.get("state") == "ready":
            return st
        if st.get("state") == "failed":
            raise SystemExit(f"error: the backbone failed to load: {st}")
        time.sleep(1)
    raise SystemExit(f"error: the backbone was not ready within {timeout:.0f} s: {st}")


def wait_job(client, job_id: str, timeout: float = 600) -> dict:
    t0 = time.time()
    while (job := client.predict(job_id, api_name="/job"))["state"] in ("queued", "running"):
        if time.time() - t0 > timeout:
            raise SystemExit(f"error: job {job_id} still {job['state']} after {timeout:.0f} s: {job['message']}")
        time.sleep(1)
    if job["state"] != "done":
        raise SystemExit(f"error: job {job_id} {job['state']}: {job.get('error')}")
    return job["result"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                isa = ("AVX-512 BF16" if " avx512_bf16" in flags else "AVX-512" if " avx512f" in flags
                       else "AVX2" if " avx2" in flags else "")
                return f"{line.split(':', 1)[1].strip()}{' ' + isa if isa else ''}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def start_container(name: str, volume: str, port: int) -> None:
    run("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:7860", "-v", f"{volume}:/data", image_name(),
        capture=True)


def smoke(do_build: bool = True) -> None:
    from gradio_client import Client

    build_s = build() if do_build else None
    if not have_image(image_name()):
        raise SystemExit(f"error: no image {image_name()} (make image)")
    size = image_size()
    torch_v = run("run", "--rm", "--network=none", image_name(), "python", "-c",
                  "import torch; print(torch.__version__)", capture=True).stdout.strip()
    log(f"torch in the image: {torch_v}")
    tag = f"pema-smoke-{os.getpid()}"
    name, volume, port = tag, tag, free_port()
    url = f"http://127.0.0.1:{port}/"
    run("volume", "create", volume, capture=True)
    try:
        t0 = time.time()
        start_container(name, volume, port)
        page_s = wait_page(url, name, timeout=600)
        log(f"first page after {page_s:.1f} s at {url}")
        key = owner_key(url)
        log("multi-user: a key from the pema_owner cookie" if key else "single-user mode (no owner cookie)")
        client = Client(url, headers={"X-Pema-Key": key} if key else None, verbose=False)
        status = wait_ready(client, timeout=600)
        ready_s = time.time() - t0
        log(f"backbone ready {ready_s:.1f} s after the start: {status.get('backbone')} on {status.get('device')}, "
            f"{status.get('precision')}, multi-user {status.get('multi_user')}")
        kept = run("exec", name, "ls", "/data/pema-studio", capture=True, check=False, quiet=True).stdout.split()
        if not kept:
            raise SystemExit("error: the studio keeps nothing in the volume's /data/pema-studio")
        log(f"data directory in the volume: /data/pema-studio holds {', '.join(sorted(kept))}")
        corpus = client.predict("", "samples.jsonl", "gettext-de", 20, api_name="/preview")
        n_de = corpus.get("count", 0)
        if not n_de:
            raise SystemExit(f"error: the gettext-de corpus is empty in the image (German .mo catalogs): {corpus}")
        log(f"gettext-de corpus: {n_de} pairs previewed")
        samples = "\n".join(json.dumps({"src": s, "tgt": t}, ensure_ascii=False) for s, t in PAIRS)
        memory_id = wait_job(client, client.predict(samples, "pairs.jsonl", "smoke pairs", "translation",
                                                    api_name="/build")["job_id"])["memory_id"]
        plugin_id = wait_job(client, client.predict(memory_id, "knn", {}, "smoke knn",
                                                    api_name="/train")["job_id"])["plugin_id"]
        t1 = time.time()
        result = client.predict("the house is small", "translation", ["base", plugin_id], {}, 12,
                                api_name="/compare")
        compare_s = time.time() - t1
        rows = result["rows"]
        if len(rows) != 2 or any(r.get("text") is None for r in rows):
            raise SystemExit(f"error: the comparison's rows: {rows}")
        for r in rows:
            log(f"  {r['label']:>24} → {r['text']!r}")
        log(f"first comparison {compare_s:.1f} s")
        share = client.predict(result["id"], api_name="/share")
        if http_get(url.rstrip("/") + share["link"])[0] != 200:
            raise SystemExit("error: the share page did not answer")
        # a restart, the way a Space restarts: stop, remove, a new container from the image on the same volume
        t2 = time.time()
        run("stop", "-t", "30", name, capture=True)
        stop_s = time.time() - t2
        logs = run("logs", name, capture=True, quiet=True)
        run("rm", name, capture=True)
        log(f"stopped in {stop_s:.1f} s")
        if stop_s > 20:
            print(logs.stdout[-2000:], logs.stderr[-2000:])
            raise SystemExit("error: the container did not stop on SIGTERM")
        start_container(name, volume, port)
        wait_page(url, name, timeout=600)
        client = Client(url, headers={"X-Pema-Key": key} if key else None, verbose=False)
        wait_ready(client, timeout=600)
        mems = {m["id"] for m in client.predict(api_name="/memories")}
        plugs = {p["id"] for p in client.predict(api_name="/plugins")}
        if memory_id not in mems or plugin_id not in plugs:
            raise SystemExit(f"error: after the restart the memory {memory_id} / plug-in {plugin_id} is gone "
                             f"(memories {sorted(mems)}, plug-ins {sorted(plugs)})")
        if client.predict(share["id"], api_name="/shared")["source"] != "the house is small":
            raise SystemExit("error: the shared comparison is gone after the restart")
        log("after the restart in a new container: the memory, the plug-in and the share are there, the key works")
    finally:
        if os.environ.get("KEEP") == "1":
            log(f"kept: container {name} ({url}), volume {volume}")
        else:
            run("rm", "-f", name, check=False, capture=True)
            run("volume", "rm", "-f", volume, check=False, capture=True)
    built = f"build {build_s:.0f} s" if build_s is not None else "build skipped"
    if build_s is not None and os.environ.get("NO_CACHE") != "1":
        built += " (layer cache allowed)"
    print(f"image-smoke OK: {image_name()} {human(size)} (torch {torch_v}) · {built} · first page {page_s:.1f} s · "
          f"backbone ready {ready_s:.1f} s · first comparison {compare_s:.1f} s · memory kept across a restart · "
          f"{dt.date.today().isoformat()} · {cpu_name()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help=f"make {LOCAL_BASE} with debootstrap")
    b.add_argument("--force", action="store_true", help="make it again even if it exists")
    sub.add_parser("build", help="build the image")
    s = sub.add_parser("smoke", help="build, then run and check the container")
    s.add_argument("--no-build", action="store_true", help="test the image as it is")
    a = p.parse_args(argv)
    if a.cmd == "base":
        make_base(force=a.force)
    elif a.cmd == "build":
        build()
    else:
        smoke(do_build=not a.no_build)


if __name__ == "__main__":
    main()
