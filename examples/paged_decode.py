"""A small paged-KV serving loop over a transformers causal LM, with attnprep
doing RoPE + the KV-cache write.

Each attention layer of the model (its own projection weights) becomes:
project q, k, v -> ``attnprep.rope_pool_fused`` (Qwen3: with the layer's
own per-head q/k norm weights, fused) into a paged cache (RoPE table from the model's
config by ``attnprep.rope_cos_sin_cache``, its rope scaling included) ->
attention over each request's pages -> the model's output projection.
Requests of different lengths join and finish at different steps
(continuous batching); a small page allocator hands out and takes back
cache pages. Greedy decoding.

    python examples/paged_decode.py                     # small random models of each family, on the GPU
    python examples/paged_decode.py --device cpu        # the same loop on the plain-torch reference backend
    python examples/paged_decode.py --model /path/to/checkpoint

``backend="reference"`` runs the RoPE + cache write in plain torch
(attnprep.testing; Qwen3's q_norm/k_norm modules) instead, on any device:
what the CPU tests use to check the loop itself against transformers' own
``generate``.
Families: Llama, Qwen3 (its per-head q/k norm), GPT-NeoX (a fused QKV
projection, partial rotary), GPT-J (GPT-J pairs, partial rotary), and the
vision-language Qwen2.5-VL and Qwen3-VL (M-RoPE: a prompt with an image
takes [3, T] positions from the model's own ``get_rope_index``, its decode
steps the position plus the prompt's rope delta; the model's own vision
tower fills the image tokens). DeepSeek-V3's multi-head latent attention
(``PagedMLAEngine``, ``make_engine`` picks it): ``attnprep.mla_rope_pool_fused``
writes the paged latent cache (the layer's kv_a_layernorm fused, q's rope part
rotated in place, bf16 or fp8 pages), attention from it in the up-projection
form.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import attnprep
import torch
import torch.nn.functional as F
from attnprep.testing import cos_sin, mrope_cos_sin_rows, rope_reference


class PageAllocator:
    """Cache pages of ``page_size`` slots: a request owns whole pages; slot
    ``page * page_size + offset`` holds its token at position ``i`` in page
    ``pages[i // page_size]``, offset ``i % page_size``."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.free_pages: List[int] = list(range(num_pages - 1, -1, -1))
        self.pages: Dict[int, List[int]] = {}

    def reserve(self, request: int, length: int) -> None:
        """Enough pages for ``length`` tokens of ``request``; ValueError when the cache is full."""
        owned = self.pages.setdefault(request, [])
        need = -(-length // self.page_size) - len(owned)
        if need > len(self.free_pages):
            raise ValueError(
                f"paged cache full: request {request} needs {need} more pages, {len(self.free_pages)} free"
            )
        owned.extend(self.free_pages.pop() for _ in range(need))

    def slots(self, request: int, start: int, count: int) -> List[int]:
        pages = self.pages[request]
        return [pages[i // self.page_size] * self.page_size + i % self.page_size for i in range(start, start + count)]

    def release(self, request: int) -> None:
        self.free_pages.extend(reversed(self.pages.pop(request, [])))


@dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new_tokens: int
    generated: List[int] = field(default_factory=list)
    # vision-language models: the prompt's image, (pixel_values, image_grid_thw [1, 3]) as the processor gives
    # them, its image tokens in the prompt; and the M-RoPE delta of the prompt (decode positions are offset by it)
    image: Optional[tuple] = None
    rope_delta: int = 0

    @property
    def length(self) -> int:  # tokens in the cache once the pending ones are written
        return len(self.prompt) + len(self.generated)


@dataclass
class Step:
    """What one forward pass computes: the packed tokens of every scheduled request."""

    positions: torch.Tensor  # [T], or M-RoPE's [3, T]
    slots: torch.Tensor
    segments: List[tuple]  # (request, start in the packed batch, tokens, context length after the step)
    # a decode step of fixed shapes (one token per row, rows padded to a bucket):
    page_table: Optional[torch.Tensor] = None  # [rows, pages per row]
    context: Optional[torch.Tensor] = None  # [rows]: tokens in the cache after the step (0: a padding row)


DECODE_BUCKETS = (1, 2, 4, 8, 16, 32)
VL_MODELS = ("qwen2_5_vl", "qwen3_vl")  # M-RoPE: positions [3, T]


# Where each family keeps its attention layers, and how they project.
def _attention_layers(model):
    kind = model.config.model_type
    if kind in ("llama", "qwen3"):
        return [(layer, "self_attn") for layer in model.model.layers]
    if kind == "gpt_neox":
        return [(layer, "attention") for layer in model.gpt_neox.layers]
    if kind == "gptj":
        return [(layer, "attn") for layer in model.transformer.h]
    if kind in VL_MODELS:
        return [(layer, "self_attn") for layer in model.model.language_model.layers]
    if kind == "deepseek_v3":
        return [(layer, "self_attn") for layer in model.model.layers]
    raise ValueError(f"paged_decode: no adapter for model type {kind}")


def _project(m, x, heads, kv_heads, head_dim):
    """q, k, v [T, h, head_dim] from the layer's own projections (views where they can be)."""
    T = x.shape[0]
    if hasattr(m, "query_key_value"):  # GPT-NeoX: per head q | k | v in one projection
        qkv = m.query_key_value(x).view(T, heads, 3 * head_dim)
        return qkv[..., :head_dim], qkv[..., head_dim : 2 * head_dim], qkv[..., 2 * head_dim :]
    q = m.q_proj(x).view(T, heads, head_dim)
    k = m.k_proj(x).view(T, kv_heads, head_dim)
    v = m.v_proj(x).view(T, kv_heads, head_dim)
    return q, k, v


def _scaling(m, head_dim):
    """The layer's softmax scale: `scaling` in recent transformers; GPT-J
    releases before it divide the scores by `scale_attn` (sqrt(head_dim))."""
    if getattr(m, "scaling", None) is not None:
        return float(m.scaling)
    if getattr(m, "scale_attn", None) is not None:
        return 1.0 / float(m.scale_attn)
    return head_dim**-0.5


def _output(m, out):
    for name in ("o_proj", "dense", "out_proj"):
        if hasattr(m, name):
            return getattr(m, name)(out)
    raise ValueError("paged_decode: the attention layer has no output projection")


class PagedEngine:
    """The model, its paged cache and the batching loop."""

    def __init__(
        self,
        model,
        *,
        page_size: int = 16,
        num_pages: int = 256,
        backend: str = "attnprep",
        pool_dtype: Optional[torch.dtype] = None,
        max_position: Optional[int] = None,
    ):
        self.model = model
        config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.backend = backend
        # the model's geometry, rotation style and RoPE table, from its config
        self.rope = attnprep.rope_kwargs_from_config(config, max_position=max_position, device=self.device)
        self.head_dim, self.heads, self.kv_heads = (self.rope[k] for k in ("head_dim", "num_qo_heads", "num_kv_heads"))
        self.rotary_dim, self.is_neox, self.table = (self.rope[k] for k in ("rotary_dim", "is_neox", "cos_sin_cache"))
        self.mrope = "mrope_section" in self.rope
        layers = _attention_layers(model)
        if any(isinstance(getattr(layer, name), PagedAttention) for layer, name in layers):
            raise ValueError("paged_decode: the model is inside another engine's generate")
        self.pool_dtype = pool_dtype or self.dtype
        # one buffer for every layer: [layers, pages, 2 (k, v), page_size, kv_heads, head_dim]
        self.cache = torch.zeros(
            len(layers),
            num_pages,
            2,
            page_size,
            self.kv_heads,
            self.head_dim,
            device=self.device,
            dtype=self.pool_dtype,
        )
        fp8 = self.pool_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.scales = (
            dict(k_scale=torch.ones((), device=self.device), v_scale=torch.ones((), device=self.device)) if fp8 else {}
        )
        self.pages = PageAllocator(num_pages, page_size)
        self.step: Optional[Step] = None
        self.graphs: Dict[int, tuple] = {}  # bucket -> (graph, its input tensors, its logits)
        self.logits: Optional[Dict[int, List[torch.Tensor]]] = None  # per request and step, when recording
        # the model's own attention layers, and the paged ones that stand in
        # for them while generate runs (the model is left as it was given)
        self.layers = [(layer, name, getattr(layer, name)) for layer, name in layers]
        self.paged = [PagedAttention(inner, i, self) for i, (_, _, inner) in enumerate(self.layers)]

    # ------------------------------------------------------------ one layer

    def rope_and_write(self, layer: int, q, k, v, m=None):
        """RoPE on q and k (after the layer's per-head q/k norm, for models
        that have one: Qwen3), the rotated k and v into this layer's pages."""
        s = self.step
        k_pool, v_pool = self.cache[layer, :, 0], self.cache[layer, :, 1]
        qk_norm = m is not None and hasattr(m, "q_norm")
        if self.backend == "attnprep":
            norm = {}
            if qk_norm:  # fused: the layer's own weights (eps and rounding from the config)
                norm = dict(q_norm_weight=m.q_norm.weight, k_norm_weight=m.k_norm.weight)
            q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
                q, k, v, s.positions, s.slots, k_pool, v_pool, **self.rope, **self.scales, **norm
            )
            return q_rot, k_rot
        if qk_norm:  # the reference runs the model's own modules
            q, k = m.q_norm(q), m.k_norm(k)
        if self.mrope:  # each frequency's row by its axis's position
            rows = mrope_cos_sin_rows(
                self.table, s.positions, self.rope["mrope_section"], self.rope["mrope_interleaved"]
            )
            cos, sin = rows[:, : self.rotary_dim // 2].cpu().double(), rows[:, self.rotary_dim // 2 :].cpu().double()
        else:
            cos, sin = cos_sin(s.positions, self.rotary_dim, cos_sin_cache=self.table)
        q_rot = rope_reference(q, cos, sin, self.rotary_dim, self.is_neox).to(q.dtype).to(q.device)
        k_rot = rope_reference(k, cos, sin, self.rotary_dim, self.is_neox).to(k.dtype).to(k.device)
        page_size = self.pages.page_size
        k_pool[s.slots // page_size, s.slots % page_size] = k_rot.to(self.pool_dtype)
        v_pool[s.slots // page_size, s.slots % page_size] = v.to(self.pool_dtype)
        return q_rot, k_rot

    def _kv(self, layer: int, pages: torch.Tensor, dtype):
        """k, v of the given pages ([..., n]), dequantized: [..., n * page_size, kv_heads, head_dim] each."""
        kv = self.cache[layer, pages]  # [..., n, 2, page_size, kv_heads, head_dim]
        shape = kv.shape[:-5] + (-1, self.kv_heads, self.head_dim)
        k, v = kv.select(-4, 0).reshape(shape).to(dtype), kv.select(-4, 1).reshape(shape).to(dtype)
        if self.scales:
            k, v = k * self.scales["k_scale"].to(dtype), v * self.scales["v_scale"].to(dtype)
        return k, v

    def attend(self, layer: int, q_rot: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of each request's new tokens over its pages: [T, heads, head_dim]."""
        s = self.step
        if s.page_table is not None:  # decode, fixed shapes: every row one query over its padded pages
            k, v = self._kv(layer, s.page_table, q_rot.dtype)  # [rows, L, kv_heads, D]
            rep = self.heads // self.kv_heads
            mask = torch.arange(k.shape[1], device=self.device)[None, :] < s.context[:, None]
            mask[:, 0] = True  # padding rows attend to something (their output is never read)
            o = F.scaled_dot_product_attention(
                q_rot[:, :, None],
                k.repeat_interleave(rep, 2).transpose(1, 2),
                v.repeat_interleave(rep, 2).transpose(1, 2),
                attn_mask=mask[:, None, None, :],
                scale=scaling,
            )
            return o[:, :, 0]
        out = torch.empty_like(q_rot)
        rep = self.heads // self.kv_heads
        for req, start, count, context in self.step.segments:
            k, v = self._kv(layer, torch.tensor(self.pages.pages[req.rid], device=self.device), q_rot.dtype)
            k, v = k[:context], v[:context]
            q = q_rot[start : start + count]
            # query i sits at position context - count + i and sees keys up to it
            mask = (
                torch.arange(context, device=self.device)[None, :]
                <= (context - count + torch.arange(count, device=self.device))[:, None]
            )
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.repeat_interleave(rep, 1).transpose(0, 1)[None],
                v.repeat_interleave(rep, 1).transpose(0, 1)[None],
                attn_mask=mask,
                scale=scaling,
            )
            out[start : start + count] = o[0].transpose(0, 1)
        return out

    # ------------------------------------------------------------ the loop

    def _decode_step(self, running: List[Request], bucket: int, max_pages: int) -> Step:
        """A decode-only step of fixed shapes: one token per running request,
        rows padded to `bucket` (padding rows: slot -1, nothing written)."""
        page_table = torch.zeros(bucket, max_pages, dtype=torch.long)
        context = torch.zeros(bucket, dtype=torch.long)
        positions = torch.zeros(bucket, dtype=torch.long)
        slots = torch.full((bucket,), -1, dtype=torch.long)
        for row, req in enumerate(running):
            self.pages.reserve(req.rid, req.length)
            owned = self.pages.pages[req.rid]
            page_table[row, : len(owned)] = torch.tensor(owned)
            context[row] = req.length
            positions[row] = req.length - 1 + req.rope_delta
            slots[row] = self.pages.slots(req.rid, req.length - 1, 1)[0]
        dev = self.device
        if self.mrope:  # a decode token's three positions are equal
            positions = positions.expand(3, -1).contiguous()
        return Step(
            positions.to(dev),
            slots.to(dev),
            [(req, row, 1, req.length) for row, req in enumerate(running)],
            page_table.to(dev),
            context.to(dev),
        )

    def _forward(self, ids: torch.Tensor, images: Optional[List[tuple]] = None) -> torch.Tensor:
        """The model over the packed tokens; a VL model's prompt images (in
        packed order) go through its own vision tower into its image tokens."""
        if not self.mrope:
            return self.model(input_ids=ids[None], position_ids=self.step.positions[None], use_cache=False).logits[0]
        pixels = {}
        if images:
            pixels = dict(
                pixel_values=torch.cat([p for p, _ in images]).to(self.device, self.dtype),
                image_grid_thw=torch.cat([g for _, g in images]).to(self.device),
            )
        positions = self.step.positions[:, None]  # [3, 1, T]
        return self.model(input_ids=ids[None], position_ids=positions, use_cache=False, **pixels).logits[0]

    def _prompt_positions(self, req: Request) -> torch.Tensor:
        """A prompt's positions: 0 ... n-1, or M-RoPE's [3, n] from the
        model's own get_rope_index (its rope delta kept for the decode steps)."""
        n = len(req.prompt)
        if not self.mrope:
            return torch.arange(n)
        ids = torch.tensor(req.prompt)[None]
        image_token = self.model.config.image_token_id
        grid = req.image[1] if req.image is not None else None
        positions, delta = self.model.model.get_rope_index(ids, (ids == image_token).int(), image_grid_thw=grid)
        req.rope_delta = int(delta)
        return positions[:, 0]

    def _replay(self, step: Step, ids: torch.Tensor, bucket: int) -> torch.Tensor:
        """The decode step as a CUDA graph per bucket: captured once (after a
        warm-up on a side stream), then its input tensors are refreshed in
        place and the graph replayed."""
        fresh = (ids, step.positions, step.slots, step.page_table, step.context)
        if bucket not in self.graphs:
            inputs = tuple(t.clone() for t in fresh)
            self.step = Step(inputs[1], inputs[2], step.segments, inputs[3], inputs[4])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(inputs[0])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._forward(inputs[0])
            self.graphs[bucket] = (graph, inputs, logits)
        graph, inputs, logits = self.graphs[bucket]
        for dst, src in zip(inputs, fresh):
            dst.copy_(src)
        self.step = Step(inputs[1], inputs[2], step.segments, inputs[3], inputs[4])
        graph.replay()
        return logits

    @torch.no_grad()
    def generate(
        self,
        requests: List[Request],
        arrivals: Optional[List[int]] = None,
        static_decode: bool = False,
        cuda_graphs: bool = False,
    ) -> Dict[int, List[int]]:
        """Greedy decoding with continuous batching: request i joins at step
        arrivals[i] (its prefill runs with the other requests' decode steps)
        and leaves, freeing its pages, after its max_new_tokens.
        static_decode: steps where every running request decodes run with
        fixed shapes (rows padded to a bucket of DECODE_BUCKETS, pages to a
        fixed count), the form a CUDA graph can replay; cuda_graphs: and
        replay them as CUDA graphs, one per bucket (implies static_decode)."""
        with self._installed():
            return self._generate(requests, arrivals, static_decode or cuda_graphs, cuda_graphs)

    @contextlib.contextmanager
    def _installed(self):
        """The paged layers in the model's place, its own restored on exit. The
        mask transformers builds for the replaced layers is never read: it is
        built the SDPA way meanwhile (the eager form, GPT-J's default, copies
        a host scalar to the device, which a CUDA graph cannot capture)."""
        config = self.model.config
        implementation = getattr(config, "_attn_implementation", None)
        for (layer, name, _), paged in zip(self.layers, self.paged):
            setattr(layer, name, paged)
        if implementation == "eager":
            config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            for layer, name, inner in self.layers:
                setattr(layer, name, inner)
            if implementation == "eager":
                config._attn_implementation = implementation

    def _generate(self, requests, arrivals, static_decode: bool, cuda_graphs: bool) -> Dict[int, List[int]]:
        max_pages = self.cache.shape[1]
        arrivals = arrivals or [0] * len(requests)
        waiting = sorted(zip(arrivals, range(len(requests))), reverse=True)
        running: List[Request] = []
        finished: Dict[int, List[int]] = {}
        step = 0
        while waiting or running:
            while waiting and waiting[-1][0] <= step:
                running.append(requests[waiting.pop()[1]])
            if not running:
                step += 1
                continue
            if static_decode and all(r.generated for r in running) and len(running) <= DECODE_BUCKETS[-1]:
                bucket = next(b for b in DECODE_BUCKETS if b >= len(running))
                self.step = self._decode_step(running, bucket, max_pages)
                ids = torch.zeros(bucket, dtype=torch.long)
                ids[: len(running)] = torch.tensor([r.generated[-1] for r in running])
                ids = ids.to(self.device)
                logits = self._replay(self.step, ids, bucket) if cuda_graphs else self._forward(ids)
                for row, req in enumerate(running):
                    self._emit(req, logits[row])
                self._retire(running, finished)
                step += 1
                continue
            ids, positions, slots, segments, images = [], [], [], [], []
            for req in running:
                new = req.prompt if not req.generated else req.generated[-1:]
                first = req.length - len(new) if req.generated else 0
                self.pages.reserve(req.rid, first + len(new))
                segments.append((req, len(ids), len(new), first + len(new)))
                ids += new
                if req.generated:
                    at = torch.tensor([first + req.rope_delta])
                    positions.append(at.expand(3, 1) if self.mrope else at)
                else:
                    positions.append(self._prompt_positions(req))
                    if req.image is not None:
                        images.append(req.image)
                slots += self.pages.slots(req.rid, first, len(new))
            dev = self.device
            self.step = Step(torch.cat(positions, -1).to(dev), torch.tensor(slots, device=dev), segments)
            logits = self._forward(torch.tensor(ids, device=dev), images)
            for req, start, count, _ in segments:
                self._emit(req, logits[start + count - 1])
            self._retire(running, finished)
            step += 1
        return finished

    def _emit(self, req: Request, logits: torch.Tensor) -> None:
        req.generated.append(int(logits.argmax()))
        if self.logits is not None:
            self.logits.setdefault(req.rid, []).append(logits.float().cpu())

    def _retire(self, running: List[Request], finished: Dict[int, List[int]]) -> None:
        for req in [r for r in running if len(r.generated) >= r.max_new_tokens]:
            running.remove(req)
            finished[req.rid] = req.generated
            self.pages.release(req.rid)


class PagedAttention(torch.nn.Module):
    """A model's attention layer on the engine's paged cache (its own weights)."""

    def __init__(self, inner, layer: int, engine: PagedEngine):
        super().__init__()
        self.inner, self.layer = inner, layer
        self.__dict__["engine"] = engine  # not a submodule
        # read once here: GPT-J keeps its scale as a device tensor, and
        # reading it in forward would synchronize (not allowed while a CUDA
        # graph captures)
        self.scaling = _scaling(inner, engine.head_dim)

    def forward(self, hidden_states, *args, **kwargs):
        m, e = self.inner, self.engine
        x = hidden_states[0]  # [T, hidden]: the packed batch
        q, k, v = _project(m, x, e.heads, e.kv_heads, e.head_dim)
        q_rot, _ = e.rope_and_write(self.layer, q, k, v, m)
        out = e.attend(self.layer, q_rot, self.scaling)
        return _output(m, out.reshape(1, x.shape[0], -1)), None


# ---------------------------------------------------------------- multi-head latent attention


class PagedMLAEngine(PagedEngine):
    """The loop for multi-head latent attention (DeepSeek-V3 and its kin): a paged latent cache of
    ``kv_lora_rank + qk_rope_head_dim`` values per token (the normalized compressed kv, then the rotated shared
    k_pe) and attention from it in the up-projection form. ``backend="attnprep"``: one
    ``attnprep.mla_rope_pool_fused`` per layer (the model's kv_a_layernorm fused, q rotated in place, bf16 or fp8
    pages); ``"reference"``: the model's own kv_a_layernorm and RoPE from the model's table in plain torch. Decode
    steps of any shape (no CUDA graphs)."""

    def __init__(self, model, *, page_size: int = 16, num_pages: int = 256, backend: str = "attnprep", pool_dtype=None):
        config = model.config
        self.model, self.backend = model, backend
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.mrope = False
        self.rope_dim, self.latent = config.qk_rope_head_dim, config.kv_lora_rank
        self.is_neox = not getattr(config, "rope_interleave", False)  # DeepSeek's interleaved pairs: GPT-J's
        params = dict(config.rope_parameters)
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        self.table = attnprep.rope_cos_sin_cache(
            self.rope_dim,
            4096,
            params["rope_theta"],
            scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            device=self.device,
        )
        layers = _attention_layers(model)
        self.pool_dtype = pool_dtype or self.dtype
        self.cache = torch.zeros(
            len(layers), num_pages, page_size, self.latent + self.rope_dim, device=self.device, dtype=self.pool_dtype
        )
        # fp8 pages: unit scale (the latent's values sit well inside e4m3's range)
        self.cache_scale = torch.ones((), device=self.device) if self.pool_dtype != self.dtype else None
        self.pages = PageAllocator(num_pages, page_size)
        self.step, self.graphs, self.logits = None, {}, None
        self.layers = [(layer, name, getattr(layer, name)) for layer, name in layers]
        self.paged = [PagedMLAAttention(inner, i, self) for i, (_, _, inner) in enumerate(self.layers)]

    def generate(self, requests, arrivals=None, static_decode=False, cuda_graphs=False):
        if static_decode or cuda_graphs:
            raise ValueError("paged_decode: multi-head latent attention decodes in steps of any shape only")
        return super().generate(requests, arrivals)

    def rope_and_write_latent(self, layer: int, q, kv_c, k_pe, norm):
        """RoPE on the rope part of q [T, heads, nope + rope] (in place) and on the shared k_pe [T, rope];
        [norm(kv_c) | k_pe rotated] into the layer's latent pages (`norm`: the model's kv_a_layernorm)."""
        s = self.step
        if self.backend == "attnprep":
            attnprep.mla_rope_pool_fused(
                q,
                kv_c,
                k_pe,
                s.positions,
                s.slots,
                self.cache[layer],
                is_neox=self.is_neox,
                cos_sin_cache=self.table,
                kv_norm_weight=norm.weight,
                norm_eps=norm.variance_epsilon,
                cache_scale=self.cache_scale,
                inplace=True,
            )
            return
        cos, sin = cos_sin(s.positions, self.rope_dim, cos_sin_cache=self.table)
        q_pe = q[..., -self.rope_dim :]
        q_pe.copy_(rope_reference(q_pe, cos, sin, self.rope_dim, self.is_neox).to(q.dtype))
        k_rot = rope_reference(k_pe[:, None], cos, sin, self.rope_dim, self.is_neox)[:, 0].to(k_pe.dtype)
        page_size = self.pages.page_size
        self.cache[layer, s.slots // page_size, s.slots % page_size] = torch.cat(
            [norm(kv_c), k_rot.to(kv_c.device)], -1
        )

    def attend_latent(self, layer: int, m, q) -> torch.Tensor:
        """Each request's new queries q [T, heads, nope + rope] (rotated) over its latent pages: k_nope and v
        up-projected by the layer's kv_b_proj, the shared rotated k_pe beside k_nope in every head; [T, heads,
        v_head_dim]."""
        heads, nope = q.shape[1], q.shape[2] - self.rope_dim
        out = q.new_empty(q.shape[0], heads, m.v_head_dim)
        for req, start, count, context in self.step.segments:
            latent = self.cache[layer, torch.tensor(self.pages.pages[req.rid], device=self.device)]
            latent = latent.reshape(-1, latent.shape[-1])[:context]
            if self.cache_scale is not None:
                latent = latent.to(self.dtype) * self.cache_scale.to(self.dtype)
            kv_c, k_pe = latent.split([self.latent, self.rope_dim], dim=-1)
            kv = m.kv_b_proj(kv_c).view(context, heads, nope + m.v_head_dim)
            k_nope, v = kv.split([nope, m.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None].expand(context, heads, self.rope_dim)], dim=-1)
            mask = (
                torch.arange(context, device=self.device)[None, :]
                <= (context - count + torch.arange(count, device=self.device))[:, None]
            )
            o = F.scaled_dot_product_attention(
                q[start : start + count].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                scale=m.scaling,
            )
            out[start : start + count] = o[0].transpose(0, 1)
        return out


def make_engine(model, **kw) -> PagedEngine:
    """The loop for the model's attention: multi-head latent (DeepSeek-V3) or the usual q, k, v."""
    return (PagedMLAEngine if model.config.model_type == "deepseek_v3" else PagedEngine)(model, **kw)


class PagedMLAAttention(torch.nn.Module):
    """A DeepSeek-V3 attention layer on the engine's latent pages (its own weights)."""

    def __init__(self, inner, layer: int, engine: PagedMLAEngine):
        super().__init__()
        self.inner, self.layer = inner, layer
        self.__dict__["engine"] = engine  # not a submodule

    def forward(self, hidden_states, *args, **kwargs):
        m, e = self.inner, self.engine
        x = hidden_states[0]  # [T, hidden]
        T = x.shape[0]
        q = m.q_proj(x) if m.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
        q = q.view(T, -1, m.qk_head_dim)
        kv_c, k_pe = m.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        e.rope_and_write_latent(self.layer, q, kv_c, k_pe, m.kv_a_layernorm)
        out = e.attend_latent(self.layer, m, q)
        return m.o_proj(out.reshape(1, T, -1)), None


# ---------------------------------------------------------------- small models


def small_model(family: str, dtype=torch.float32, device="cuda", seed=0, layers=2):
    """A small model of the family with seeded random weights and real head geometry."""
    transformers = _transformers()

    torch.manual_seed(seed)
    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # a vocabulary of 1000
    # Llama 3's text geometry (8 q heads, 2 kv heads of 128), shared by the families that take it
    text = dict(
        hidden_size=1024,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=1000,
        max_position_embeddings=4096,
        **no_special,
    )
    if family == "llama":
        config = transformers.LlamaConfig(
            **text,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        )
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**text, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = transformers.Qwen3ForCausalLM(config)
    elif family == "gpt_neox":  # rotary over a quarter of each head
        mha = {k: v for k, v in text.items() if k not in ("num_key_value_heads", "head_dim")}
        config = transformers.GPTNeoXConfig(**mha, rotary_pct=0.25)
        model = transformers.GPTNeoXForCausalLM(config)
    elif family == "gptj":  # GPT-J pairs over the first 64 of 128 elements
        config = transformers.GPTJConfig(
            n_embd=1024, n_head=8, rotary_dim=64, n_layer=layers, vocab_size=1000, n_positions=4096, **no_special
        )
        model = transformers.GPTJForCausalLM(config)
    elif family == "deepseek_v3":  # MLA at DeepSeek-V3's per-head geometry, YaRN with its mscale, dense layers
        config = transformers.DeepseekV3Config(
            hidden_size=1024,
            intermediate_size=1536,
            moe_intermediate_size=256,
            num_hidden_layers=layers,
            first_k_dense_replace=layers,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=256,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            vocab_size=1000,
            max_position_embeddings=163840,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            **no_special,
        )
        model = transformers.DeepseekV3ForCausalLM(config)
    elif family in VL_MODELS:  # a small vision tower (patches of 4 x 4 pixels)
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=4, out_hidden_size=1024)
        tokens = dict(image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993)
        if family == "qwen2_5_vl":  # sections
            rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 24, 24]}
            config = transformers.Qwen2_5_VLConfig(
                text_config=dict(text, rope_parameters=rope),
                vision_config=dict(vision, window_size=16, fullatt_block_indexes=[1]),
                **tokens,
            )
            model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        else:  # interleaved sections, the per-head q/k norm, deepstack features
            rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20]}
            config = transformers.Qwen3VLConfig(
                text_config=dict(text, rope_parameters=dict(rope, mrope_interleaved=True)),
                vision_config=dict(vision, num_position_embeddings=64, deepstack_visual_indexes=[0]),
                **tokens,
            )
            model = transformers.Qwen3VLForConditionalGeneration(config)
        # q and k sharpened: random weights attend almost uniformly, so a wrong position axis would barely show
        with torch.no_grad():
            for layer in model.model.language_model.layers:
                layer.self_attn.q_proj.weight.mul_(2.0)
                layer.self_attn.k_proj.weight.mul_(2.0)
    else:
        raise ValueError(f"paged_decode: unknown family {family}")
    return model.to(device=device, dtype=dtype).eval()


def make_requests(model, lengths, new_tokens, generator) -> List[Request]:
    """Requests of random prompts with `lengths` text tokens; for a VL model
    every other one also holds an image (random pixels, 8 x 12 or 12 x 8
    patches of 4 x 4 pixels, 24 image tokens) in the middle of its text."""
    config = model.config
    vl = config.model_type in VL_MODELS
    requests = []
    for i, n in enumerate(lengths):
        prompt = torch.randint(0, 980 if vl else 1000, (n,), generator=generator).tolist()  # below VL's special ids
        image = None
        if vl and i % 2 == 0:
            vc = config.vision_config
            t, h, w = (1, 8, 12) if i % 4 == 0 else (1, 12, 8)
            image_tokens = [config.image_token_id] * (t * h * w // vc.spatial_merge_size**2)
            image_part = [config.vision_start_token_id] + image_tokens + [config.vision_end_token_id]
            prompt = prompt[: n // 2] + image_part + prompt[n // 2 :]
            pixels = torch.randn(
                t * h * w, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2, generator=generator
            )
            image = (pixels, torch.tensor([[t, h, w]]))
        requests.append(Request(i, prompt, new_tokens[i] if isinstance(new_tokens, list) else new_tokens, image=image))
    return requests


def model_inputs(model, req: Request, ids: torch.Tensor) -> dict:
    """What transformers' own forward and generate take besides the token ids
    ``[1, n]`` for `req`: a VL prompt's image, and which tokens are its."""
    if req.image is None:
        return {}
    dev = ids.device
    return dict(
        pixel_values=req.image[0].to(dev, next(model.parameters()).dtype),
        image_grid_thw=req.image[1].to(dev),
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
    )


def generate_reference(model, req: Request) -> List[int]:
    """transformers' own greedy generate for one request."""
    ids = torch.tensor(req.prompt, device=next(model.parameters()).device)[None]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=req.max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **model_inputs(model, req, ids),
    )
    return out[0, ids.shape[1] :].tolist()


def _events_us(fn, repeats: int = 200) -> float:
    """Mean time of fn() on the GPU (CUDA events around `repeats` calls)."""
    for _ in range(10):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / repeats


@torch.no_grad()
def op_share(engine: PagedEngine) -> tuple:
    """(step us, attnprep us, share) for the largest decode bucket captured:
    the step's graph replayed, against a graph of the same rope_pool_fused
    calls alone (one per layer, the step's shapes, the layer's own q/k norm
    weights) replayed the same way."""
    bucket = max(engine.graphs)
    step_us = _events_us(engine.graphs[bucket][0].replay)
    dev, dt, D = engine.device, engine.dtype, engine.head_dim
    q = torch.randn(bucket, engine.heads, D, device=dev, dtype=dt)
    k = torch.randn(bucket, engine.kv_heads, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    # the first slots of the cache: the run is over, its pages are free
    positions = torch.arange(bucket, device=dev)
    engine.step = Step(positions.expand(3, -1) if engine.mrope else positions, torch.arange(bucket, device=dev), [])
    inner = [m for _, _, m in engine.layers]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i, m in enumerate(inner):
            engine.rope_and_write(i, q, k, v, m)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for i, m in enumerate(inner):
            engine.rope_and_write(i, q, k, v, m)
    op_us = _events_us(graph.replay)
    return step_us, op_us, op_us / step_us


def _transformers():
    try:
        import transformers
    except ImportError:
        sys.exit("paged_decode: needs transformers: pip install 'transformers>=5.25,<6'")
    return transformers


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python examples/paged_decode.py",
        description="Greedy decoding with continuous batching over a paged KV cache: each attention layer of a "
        "transformers model runs its own projections, attnprep.rope_pool_fused (RoPE, the QK norm where the "
        "model has one, the cache write) and attention over its pages; the tokens are checked against the "
        "model's own generate(). On a GPU the decode steps replay as CUDA graphs and the table gives "
        "tokens/s and rope_pool_fused's share of a step; on the CPU (--device cpu) the loop runs on the "
        "plain-torch reference backend.",
    )
    p.add_argument("--model", help="a local checkpoint directory (default: small random models of each family)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: attnprep's kernels and CUDA graphs (default where a GPU is present); "
        "cpu: the plain-torch reference backend",
    )
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("paged_decode: no CUDA device here; run with --device cpu for the plain-torch reference backend")
    transformers = _transformers()
    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if a.model:
        models = [("checkpoint", transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype))]
    else:
        models = [(f, small_model(f, dtype, "cpu")) for f in ("llama", "qwen3", "gpt_neox", "gptj", *VL_MODELS)]
    print(
        "| model | device | requests x new tokens | tokens equal to generate() | attnprep loop tok/s | "
        "transformers generate tok/s | decode step us (rows) | rope_pool_fused us per step | share of the step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name, model in models:
        model = model.to(a.device).eval()
        lengths = (5, 33, 17, 64)
        fresh = lambda: make_requests(model, lengths, a.new_tokens, torch.Generator().manual_seed(0))  # noqa: E731
        generate_reference(model, Request(0, fresh()[0].prompt[:5], 2))  # warm-up: the first call pays one-time costs
        sync()
        t0 = time.perf_counter()
        # one request at a time, as generate takes them unpadded
        reference = {req.rid: generate_reference(model, req) for req in fresh()}
        sync()
        t_hf = time.perf_counter() - t0
        engine = PagedEngine(model, backend="attnprep" if cuda else "reference")
        for _ in range(2 if cuda else 1):  # on the GPU the first run captures the graphs
            requests = fresh()
            sync()
            t0 = time.perf_counter()
            got = engine.generate(requests, arrivals=[0, 0, 3, 7], cuda_graphs=cuda)
            sync()
            t_ours = time.perf_counter() - t0
        same = sum(got[i] == reference[i] for i in reference)
        n = len(lengths) * a.new_tokens
        step = "- | - | -"
        if cuda:
            step_us, op_us, share = op_share(engine)
            step = f"{step_us:.0f} ({max(engine.graphs)}) | {op_us:.1f} | {100 * share:.1f}%"
        print(
            f"| {name} | {a.device} | {len(lengths)} x {a.new_tokens} | {same} of {len(lengths)} | {n / t_ours:.0f} | "
            f"{n / t_hf:.0f} | {step} |"
        )


if __name__ == "__main__":
    main()
