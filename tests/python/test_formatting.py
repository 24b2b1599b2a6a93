"""The tree's formatting is mechanical: clang-format (.clang-format) for the
C++, CUDA and Metal sources and ruff (pyproject.toml) for the Python, at the
versions pinned in pyproject.toml's test extra (scripts/setup.sh installs them)."""

import pathlib
import re
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
C_SUFFIXES = {".h", ".cpp", ".cu", ".cuh", ".metal"}
# the project's Python (not whatever else a checkout holds: a scratch folder, a venv)
PY_DIRS = ["python", "tests", "bench", "examples", "tools"]


def pinned(name):
    extra = (ROOT / "pyproject.toml").read_text()
    return re.search(rf'"{re.escape(name)}==([0-9.]+)"', extra).group(1)


def tool(name):
    """The pinned tool installed beside this interpreter (not another one on PATH)."""
    exe = pathlib.Path(sysconfig.get_path("scripts")) / name
    assert exe.exists(), f"{name} is not installed for {sys.executable}: pip install {name}=={pinned(name)}"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    assert pinned(name) in version, f"{name} {version.strip()} found; the tree is formatted with {pinned(name)}"
    return str(exe)


def c_sources():
    dirs = [ROOT / "src", ROOT / "tests" / "cpp", ROOT / "tests" / "metal"]
    return sorted(str(p) for d in dirs for p in d.rglob("*") if p.suffix in C_SUFFIXES)


def test_cpp_cuda_and_metal_sources_are_clang_formatted():
    files = c_sources()
    assert len(files) > 50
    run = subprocess.run([tool("clang-format"), "--dry-run", "--Werror", *files], capture_output=True, text=True)
    assert run.returncode == 0, "run clang-format -i on:\n" + run.stderr[-4000:]


def test_python_is_ruff_clean_and_formatted():
    ruff = tool("ruff")
    lint = subprocess.run([ruff, "check", "--no-cache", *PY_DIRS], capture_output=True, text=True, cwd=ROOT)
    assert lint.returncode == 0, lint.stdout[-4000:]
    fmt = subprocess.run([ruff, "format", "--check", "--no-cache", *PY_DIRS], capture_output=True, text=True, cwd=ROOT)
    assert fmt.returncode == 0, "run ruff format on:\n" + fmt.stdout[-4000:]
