"""A normal install finds the CUDA sources: the wheel is built, installed (not editable) into a temporary folder, and
every kernel source is resolved there, with its headers inlined, by a Python that sees that folder and not the
checkout. No CuPy: resolving a source is file work (kernel_source.py)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cudflash.backends import kernel_source

ROOT = Path(__file__).resolve().parents[1]
RESOLVE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import cudflash
from cudflash.backends import kernel_source
names = kernel_source.module_names()
print(json.dumps({"package": cudflash.__file__, "root": str(kernel_source.kernel_root()), "names": names,
                  "sources": {n: kernel_source.source(n) for n in names}, "cupy": "cupy" in sys.modules,
                  "path": sys.path}))
"""


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"],
                          capture_output=True, text=True)


def _tail(r: subprocess.CompletedProcess) -> str:
    return " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])


def _installed_setuptools_builds(pyproject: Path) -> bool:
    """Whether the installed setuptools meets the build-system's minimum (so no isolated environment is needed)."""
    try:
        import setuptools
    except ImportError:
        return False
    need = next((r for r in tomllib.loads(pyproject.read_text())["build-system"]["requires"]
                 if r.startswith("setuptools")), "setuptools")
    minimum = re.search(r">=\s*([\d.]+)", need)
    have = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    return minimum is None or have >= tuple(int(x) for x in minimum.group(1).split(".")[:2])


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the package sources (the checkout is left as it is: setuptools builds in place).
    With the installed setuptools where it is new enough, else in pip's isolated build environment from the
    configured package index; skips, saying why, where neither can build offline."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("cudflash", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp / "dist"
    common = ("wheel", "--no-deps", "-w", str(out), str(src))
    if _installed_setuptools_builds(src / "pyproject.toml"):
        r = _pip(*common, "--no-build-isolation", "--no-index")
    else:
        r = _pip(*common, "--retries", "0", "--timeout", "15")
    if r.returncode != 0:
        pytest.skip(f"the wheel cannot be built offline here: {_tail(r)}")
    return next(out.glob("cudflash-*.whl"))


def _lines_by_file(text: str) -> str:
    """The source with each `#line N "path"` naming only the file."""
    return re.sub(r'^#line (\d+) ".*/([^/"]+)"$', r'#line \1 "\2"', text, flags=re.M)


def test_an_installed_wheel_resolves_every_kernel_source(tmp_path):
    wheel = build_wheel(tmp_path)
    target = tmp_path / "site"
    r = _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel))
    assert r.returncode == 0, _tail(r)
    # -I: no PYTHONPATH, no user site and not the working folder; the script puts the install first on the path.
    run = subprocess.run([sys.executable, "-I", "-c", RESOLVE, str(target)], capture_output=True, text=True,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    installed = (target / "cudflash").resolve()
    assert Path(got["package"]).resolve().parent == installed
    assert Path(got["root"]).resolve() == installed / "kernels"
    assert not any(Path(p).resolve() == ROOT for p in got["path"] if p)
    assert not got["cupy"]

    checkout = sorted(p.stem for p in (ROOT / "kernels").glob("*.cu"))
    assert list(got["names"]) == checkout == list(kernel_source.module_names())
    for name, text in got["sources"].items():
        files = set(re.findall(r'^#line \d+ "(.*)"$', text, flags=re.M))
        assert files and all(Path(f).resolve().parent == installed / "kernels" for f in files), name
        assert not re.search(r'^\s*#\s*include\s+"', text, flags=re.M), name  # every local header inlined
        assert _lines_by_file(text) == _lines_by_file(kernel_source.source(name)), name


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject.toml lists packages by hand: a new subpackage left out would install without it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cudflash").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
