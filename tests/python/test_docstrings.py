"""The public functions' docstrings: numpydoc sections naming every
parameter, and examples that run (those on CUDA tensors where a GPU is; the
Ulysses ones need a process group of several ranks and are not run here)."""

import doctest
import inspect
import re

import attnprep
import pytest
import torch
from attnprep import ulysses

PUBLIC = {
    "pack_qkv_destination_major": (attnprep.pack_qkv_destination_major, "cuda"),
    "usp_merge_heads": (attnprep.usp_merge_heads, "cuda"),
    "rope_pool_fused": (attnprep.rope_pool_fused, "cuda"),
    "qk_norm_rope": (attnprep.qk_norm_rope, "cuda"),
    "rope_cos_sin_cache": (attnprep.rope_cos_sin_cache, "cpu"),
    "rope_kwargs_from_config": (attnprep.rope_kwargs_from_config, "cpu"),
    "rope_cos_sin_rows": (attnprep.rope_cos_sin_rows, "cpu"),
    "ulysses_attention": (ulysses.ulysses_attention, None),
    "scatter_heads": (ulysses.scatter_heads, None),
    "gather_heads": (ulysses.gather_heads, None),
}
RUNNABLE = [name for name, (_, where) in PUBLIC.items() if where]
SECTIONS = ("Parameters", "Returns", "Raises", "Examples")


@pytest.mark.parametrize("name", PUBLIC)
def test_sections_and_every_parameter(name):
    fn, _ = PUBLIC[name]
    doc = inspect.getdoc(fn)
    for section in SECTIONS:
        assert f"\n{section}\n{'-' * len(section)}\n" in doc, f"{name}: no {section} section"
    documented = doc.split("\nParameters\n")[1].split("\nReturns\n")[0]
    named = {n.strip() for line in re.findall(r"^(\w[\w, ]*) :", documented, re.M) for n in line.split(",")}
    assert set(inspect.signature(fn).parameters) == named


@pytest.mark.parametrize("name", RUNNABLE)
def test_examples_run(name):
    fn, where = PUBLIC[name]
    if where == "cuda" and not torch.cuda.is_available():
        pytest.skip("its example runs on CUDA tensors")
    finder = doctest.DocTestFinder(recurse=False)
    (test,) = finder.find(fn, name, globs={"torch": torch, name: fn, **vars(ulysses)})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test)
    assert result.failed == 0 and result.attempted > 0
