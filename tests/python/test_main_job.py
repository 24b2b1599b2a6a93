"""`python -m attnprep` exactly as the README runs it (no flags), and every
Python snippet of the README: on a GPU they run; on any machine the main job
runs its CPU part and each snippet is checked for names it never defines."""

import ast
import builtins
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MULTICAST_OFF, requires_cuda

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_main_job_and_the_tests():
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "python3 -m attnprep" in first and "bash scripts/test.sh" in first


def test_main_job_without_flags():
    run = subprocess.run([sys.executable, "-m", "attnprep"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert out.startswith("attnprep ") and "Self-check" in out
    assert "  ok    validation" in out
    if torch.cuda.is_available():
        for op in (
            "pack_qkv_destination_major",
            "usp_merge_heads",
            "rope_pool_fused",
            "qk_norm_rope",
            "mla_rope_pool_fused",
        ):
            assert f"  ok    {op} (CUDA)" in out
        assert "### Short benchmark" in out and "| attnprep us |" in out
        assert out.rstrip().endswith("self-check passed: every op ran on this GPU and matched its reference")
    else:
        assert "Short benchmark: skipped" in out
        assert out.rstrip().endswith("self-check passed for validation only: no kernel ran (they need a GPU)")


def snippets():
    return re.findall(r"```python\n(.*?)```", README, re.S)


def undefined_names(src: str):
    tree = ast.parse(src)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined)


def test_readme_snippets_define_every_name_they_use():
    assert len(snippets()) >= 2
    for src in snippets():
        assert undefined_names(src) == [], src


@requires_cuda
@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", README))))
def test_readme_snippet_runs(index, tmp_path):
    src = snippets()[index]
    path = tmp_path / "snippet.py"
    path.write_text(src)
    if "torchrun" in src:
        nproc = 2 if torch.cuda.device_count() >= 2 else 1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    env = dict(os.environ, **MULTICAST_OFF)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
