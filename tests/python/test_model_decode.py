"""examples/paged_decode.py inside real model code: transformers' own Llama,
Qwen3, GPT-NeoX, GPT-J, Qwen2.5-VL and Qwen3-VL (small configs, seeded random
weights, real head geometry; the VL models with images in half the prompts,
M-RoPE positions from their own get_rope_index), each attention layer on a
paged cache, continuous batching; the generated tokens against transformers'
own generate(do_sample=False).

On the CPU the loop runs its plain-torch RoPE + cache write (the loop's own
logic against transformers); on a GPU it runs attnprep.rope_pool_fused."""

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import paged_decode as pd  # noqa: E402


def test_page_allocator():
    pages = pd.PageAllocator(num_pages=4, page_size=16)
    pages.reserve(0, 17)  # two pages
    pages.reserve(1, 16)  # one
    assert pages.pages == {0: [0, 1], 1: [2]}
    assert pages.slots(0, 14, 4) == [14, 15, 16, 17]
    assert pages.slots(1, 0, 2) == [32, 33]
    pages.reserve(0, 17)  # already enough
    assert pages.pages[0] == [0, 1]
    with pytest.raises(ValueError) as e:
        pages.reserve(1, 40)
    assert str(e.value) == "paged cache full: request 1 needs 2 more pages, 1 free"
    pages.release(0)  # its pages are handed out again, lowest first
    pages.reserve(1, 40)
    assert pages.pages[1] == [2, 0, 1]
    assert pages.slots(1, 16, 1) == [0] and pages.slots(1, 32, 1) == [16]
    assert pages.free_pages == [3]


def reference_tokens(model, requests):
    """transformers' own greedy generate, one request at a time."""
    return {req.rid: pd.generate_reference(model, req) for req in requests}


def run(family, device, backend, new_tokens, dtype=torch.float32, static_decode=False, cuda_graphs=False, **engine_kw):
    pytest.importorskip("transformers")
    model = pd.small_model(family, dtype, device)
    reference = copy.deepcopy(model)
    lengths = [new_tokens, new_tokens // 2, new_tokens, new_tokens // 3]
    requests = pd.make_requests(model, (5, 19, 3, 33), lengths, torch.Generator().manual_seed(1))
    want = reference_tokens(reference, requests)
    engine = pd.PagedEngine(model, page_size=16, num_pages=64, backend=backend, **engine_kw)
    got = engine.generate(
        requests,
        arrivals=[0, 0, 2, 5],
        static_decode=static_decode,  # join and leave mid-run
        cuda_graphs=cuda_graphs,
    )
    assert sorted(engine.pages.free_pages) == list(range(64))  # every page came back
    return got, want


FAMILIES = ["llama", "qwen3", "gpt_neox", "gptj", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loop_against_transformers_on_the_cpu(family):
    got, want = run(family, "cpu", "reference", 12)
    assert got == want


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_wrong_mrope_axis_changes_the_image_requests_tokens(family):
    """The control: the loop with the other interleaving, or every frequency
    on the time axis, no longer matches generate for the prompts with an image
    (the text-only ones, whose three positions are equal, still do)."""
    pytest.importorskip("transformers")
    model = pd.small_model(family, torch.float32, "cpu")
    requests = lambda: pd.make_requests(model, (5, 19, 3, 33), 12, torch.Generator().manual_seed(1))  # noqa: E731
    want = reference_tokens(copy.deepcopy(model), requests())
    for wrong in (dict(mrope_interleaved=family == "qwen2_5_vl"), dict(mrope_section=[64, 0, 0])):
        engine = pd.PagedEngine(model, page_size=16, num_pages=64, backend="reference")
        engine.rope.update(wrong)
        got = engine.generate(requests(), arrivals=[0, 0, 2, 5])
        assert [got[i] == want[i] for i in range(4)] == [False, True, False, True], wrong


def test_mla_latent_cache_loop_against_transformers_on_the_cpu():
    """DeepSeek-V3 (MLA at its per-head geometry, YaRN with mscale): the latent cache holds the model's
    kv_a_layernorm output and the rotated k_pe; attention from it equals generate token for token, and with
    NeoX pairs instead of DeepSeek's interleaved ones it does not."""
    pytest.importorskip("transformers")
    model = pd.small_model("deepseek_v3", torch.float32, "cpu")
    requests = lambda: pd.make_requests(model, (5, 19, 3, 33), [12, 6, 12, 4], torch.Generator().manual_seed(1))  # noqa: E731
    want = reference_tokens(copy.deepcopy(model), requests())
    engine = pd.make_engine(model, page_size=16, num_pages=64, backend="reference")
    assert engine.cache.shape == (2, 64, 16, 512 + 64)
    assert engine.generate(requests(), arrivals=[0, 0, 2, 5]) == want
    assert sorted(engine.pages.free_pages) == list(range(64))
    control = pd.make_engine(model, page_size=16, num_pages=64, backend="reference")
    control.is_neox = True
    got = control.generate(requests(), arrivals=[0, 0, 2, 5])
    assert got != want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mla_with_attnprep_float32_token_for_token():
    """DeepSeek-V3 with attnprep.mla_rope_pool_fused writing the paged latent cache (kv_a_layernorm fused, q
    rotated in place): float32 tokens equal transformers' generate over 48 new tokens."""
    pytest.importorskip("transformers")
    model = pd.small_model("deepseek_v3", torch.float32, "cuda")
    requests = lambda: pd.make_requests(model, (5, 19, 3, 33), [48, 24, 48, 16], torch.Generator().manual_seed(1))  # noqa: E731
    want = reference_tokens(copy.deepcopy(model), requests())
    engine = pd.make_engine(model, page_size=16, num_pages=64, backend="attnprep")
    assert engine.generate(requests(), arrivals=[0, 0, 2, 5]) == want
    assert sorted(engine.pages.free_pages) == list(range(64))


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3_vl"])
def test_fixed_shape_decode_steps_on_the_cpu(family):
    """Decode steps padded to a bucket, pages to a fixed count, context as a
    mask: the shapes a CUDA graph replays, and the same tokens."""
    got, want = run(family, "cpu", "reference", 12, static_decode=True)
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_attnprep_in_the_model_float32_token_for_token(family):
    got, want = run(family, "cuda", "attnprep", 64)
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_replayed_as_cuda_graphs(family):
    got, want = run(family, "cuda", "attnprep", 64, cuda_graphs=True)
    assert got == want


def bf16_against_transformers(family, device, backend, new_tokens):
    """A bf16 model through the loop and through transformers' own bf16 run:
    (greedy-token agreement rate with transformers' generate, worst per-step
    logit error over max |logit|). The logits compare at EVERY step: the
    reference is the model's forward over the prompt and the tokens the loop
    chose, so that a near-tie flipping one greedy token (random small models
    have many) does not end the comparison (except where the loop chose a VL
    model's image-placeholder id after an image, see below)."""
    pytest.importorskip("transformers")
    model = pd.small_model(family, torch.bfloat16, device)
    reference = copy.deepcopy(model)
    requests = lambda: pd.make_requests(model, (5, 19, 3, 33), new_tokens, torch.Generator().manual_seed(1))  # noqa: E731
    engine = pd.make_engine(model, page_size=16, num_pages=64, backend=backend)
    engine.logits = {}
    got = engine.generate(requests(), arrivals=[0, 0, 2, 5])
    agree = worst = 0.0
    prompts = [req.prompt for req in requests()]
    for i, req in enumerate(requests()):
        prompt = req.prompt
        want = pd.generate_reference(reference, req)
        n = 0
        while n < len(want) and want[n] == got[i][n]:
            n += 1
        agree += n / len(want) / len(prompts)
        seq = torch.tensor(prompt + got[i][:-1], device=device)[None]
        steps = new_tokens
        if req.image is not None and model.config.image_token_id in got[i][:-1]:
            # a generated image-placeholder id cannot go through one forward with the prompt's image (the model
            # counts it as an image token): generate's own logits, up to the step where the tokens part
            out = reference.generate(
                seq[:, : len(prompt)],
                attention_mask=torch.ones_like(seq[:, : len(prompt)]),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
                **pd.model_inputs(reference, req, seq[:, : len(prompt)]),
            )
            forced = torch.stack([step[0] for step in out.logits]).float().cpu()
            steps = min(n + 1, new_tokens)
        else:
            with torch.no_grad():
                kw = pd.model_inputs(reference, req, seq)
                forced = reference(seq, attention_mask=torch.ones_like(seq), **kw).logits[0, len(prompt) - 1 :]
                forced = forced.float().cpu()
        assert forced.shape[0] == len(engine.logits[i]) == new_tokens
        for step in range(steps):
            a, b = forced[step], engine.logits[i][step]
            worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
    print(f"{family} bf16: greedy tokens agree {100 * agree:.1f}%, worst logit error {worst:.4f} of max |logit|")
    return agree, worst


# The stated tolerance of the bf16 comparison: per-step logits within 5% of
# the step's largest logit (the loop's own plain-torch path measured 0.8-1.5%
# on the CPU, the differences being bf16 rounding in other orders); 8% for the
# VL test models, whose sharpened attention (q and k x 2) amplifies the same
# rounding (plain-torch path: 4.8% Qwen2.5-VL, 2.1% Qwen3-VL over 64 tokens).
BF16_LOGIT_TOLERANCE = 0.05
BF16_LOGIT_TOLERANCE_VL = 0.08


def bf16_tolerance(family):
    return BF16_LOGIT_TOLERANCE_VL if family in pd.VL_MODELS else BF16_LOGIT_TOLERANCE


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_5_vl", "deepseek_v3"])
def test_bf16_logits_of_the_loop_on_the_cpu(family):
    agree, worst = bf16_against_transformers(family, "cpu", "reference", 12)
    assert worst <= bf16_tolerance(family)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES + ["deepseek_v3"])
def test_bf16_logits_with_attnprep_against_transformers_bf16(family):
    """bf16 model with rope_pool_fused (Qwen3: its norm fused) against
    transformers' own bf16 forward: every step's logits within the stated
    tolerance (the greedy agreement with generate is printed, not asserted:
    near-ties in a random model flip on bf16 rounding order)."""
    agree, worst = bf16_against_transformers(family, "cuda", "attnprep", 64)
    assert worst <= bf16_tolerance(family)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_fp8_pool_logits_against_the_bf16_pool(family):
    """fp8 (e4m3, unit scales) instead of bf16 cache pages (DeepSeek-V3: its
    latent pages): the error it adds to the first step's logits (the prefill
    reads its keys and values back from the cache), reported."""
    pytest.importorskip("transformers")
    first = {}
    for pool_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        engine = pd.make_engine(
            pd.small_model(family, torch.bfloat16, "cuda"), num_pages=64, backend="attnprep", pool_dtype=pool_dtype
        )
        engine.logits = {}
        g = torch.Generator().manual_seed(2)
        engine.generate([pd.Request(0, torch.randint(0, 1000, (40,), generator=g).tolist(), 1)])
        first[pool_dtype] = engine.logits[0][0]
    err = (first[torch.float8_e4m3fn] - first[torch.bfloat16]).abs().max().item()
    scale = first[torch.bfloat16].abs().max().item()
    print(f"{family} fp8 pool: max |logit error| {err:.3g} against max |logit| {scale:.3g}")
    assert 0 < err < 0.25 * scale  # fp8 does change them, within a sanity bound; the value is what gets reported


def test_the_model_is_left_as_it_was_given_and_serves_a_second_engine():
    pytest.importorskip("transformers")
    model = pd.small_model("gptj", torch.float32, "cpu", layers=1)
    layers = [(layer, name, getattr(layer, name)) for layer, name in pd._attention_layers(model)]
    implementation = model.config._attn_implementation
    requests = lambda: [pd.Request(0, [1, 2, 3], 4)]  # noqa: E731
    first = pd.PagedEngine(model, page_size=16, num_pages=4, backend="reference").generate(requests())
    assert all(getattr(layer, name) is inner for layer, name, inner in layers)
    assert model.config._attn_implementation == implementation
    second = pd.PagedEngine(model, page_size=16, num_pages=4, backend="reference").generate(requests())
    assert first == second == reference_tokens(model, requests())


def test_command_line_on_the_cpu(capsys):
    pytest.importorskip("transformers")
    pd.main(["--device", "cpu", "--new-tokens", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "cpu" in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| llama",
        "| qwen3",
        "| gpt_neox",
        "| gptj",
        "| qwen2_5_vl",
        "| qwen3_vl",
    ]
    assert all(" | 4 of 4 | " in r for r in rows), rows


def test_command_line_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        pd.main(["--device", "cuda"])
    assert str(e.value) == (
        "paged_decode: no CUDA device here; run with --device cpu for the plain-torch reference backend"
    )
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it raises ImportError
    with pytest.raises(SystemExit) as e:
        pd.main(["--device", "cpu"])
    assert str(e.value) == "paged_decode: needs transformers: pip install 'transformers>=5.25,<6'"
