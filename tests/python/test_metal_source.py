"""Strict syntax pass over the Metal source, on any machine: clang parses
src/metal/rope_pool.metal as C++ through tests/metal/shim, with device,
constant and threadgroup as distinct address spaces, and any diagnostic fails.
(The emulation that runs the kernel is the ctest test_metal_emulation.)"""

from pathlib import Path

import pytest

try:
    import clang.cindex as cindex
except ImportError:  # each test here fails on its own; the rest of the suite still runs
    cindex = None

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "-x",
    "c++",
    "-std=c++17",
    "-nostdinc",
    "-nostdinc++",
    "-DATTNPREP_METAL_SYNTAX_CHECK",
    "-D__METAL_VERSION__=310",
    f"-I{ROOT / 'tests/metal/shim'}",
    f"-I{ROOT / 'src/core'}",
    "-Wall",
    "-Wextra",
    "-Wno-unknown-attributes",  # [[buffer(0)]] and friends are Metal's, unknown to C++
]


def compiler_messages(path: Path, text: str = None):
    """The warnings and errors of a strict C++ parse, as "file:line: text"."""
    if cindex is None:
        pytest.fail("libclang is not installed (scripts/setup.sh installs it where a package index is reachable)")
    index = cindex.Index.create()
    unsaved = [(str(path), text)] if text is not None else None
    tu = index.parse(str(path), args=ARGS, unsaved_files=unsaved)
    lib = cindex.conf.lib  # the translation unit's messages, through libclang's C API
    found = (cindex.Diagnostic(lib.clang_getDiagnostic(tu, i)) for i in range(lib.clang_getNumDiagnostics(tu)))
    return [f"{d.location.file}:{d.location.line}: {d.spelling}" for d in found]


def test_rope_pool_metal_is_clean():
    assert compiler_messages(ROOT / "src/metal/rope_pool.metal") == []


def test_token_rms_norm_metal_is_clean():
    assert compiler_messages(ROOT / "src/metal/token_rms_norm.metal") == []


def test_the_pass_catches_address_space_mistakes():
    path = ROOT / "src/metal/rope_pool.metal"
    source = path.read_text()
    # threadgroup memory through a plain pointer, and a device pointer into a threadgroup one
    broken = source.replace("    cos_t[i] = r.c;", "    float* bad = cos_t;\n    bad[i] = r.c;")
    assert broken != source
    found = compiler_messages(path, broken)
    assert any("address_space(3)" in d for d in found), found
    broken = source.replace("device const T* in = is_q ? q : k;", "threadgroup const T* in = is_q ? q : k;")
    assert broken != source
    assert compiler_messages(path, broken), "a device pointer stored as threadgroup went unnoticed"
