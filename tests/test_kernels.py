"""The native CPU ops (ddtree/kernels) against torch, and the runner's forwards on them against Hugging Face."""

import importlib.util
import logging
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ddtree.kernels as kernels
from ddtree.models.target import TargetModel
from ddtree.models.testing import write_random_target

HAS_NINJA = shutil.which("ninja") is not None or importlib.util.find_spec("ninja") is not None
HAS_TOOLCHAIN = (
    (shutil.which("c++") is not None or shutil.which("g++") is not None)
    and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()
    and HAS_NINJA
)
pytestmark = pytest.mark.skipif(
    not HAS_TOOLCHAIN,
    reason="no C++ compiler, Python headers or ninja: the runner uses torch's kernels (tested elsewhere)",
)

EMPTY = torch.empty(0)


@pytest.fixture(scope="module")
def ops():
    if not kernels.kernels_enabled():
        pytest.skip("DDTREE_CPU_KERNELS=0 in the environment")
    module = kernels.cpu_ops()
    assert module is not None, "a C++ compiler is present, so the native ops must build (see the logged warning)"
    return module


def rope_reference(x, cos, sin):  # x [heads, D]: Hugging Face's rotate-half convention
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k, n", [(576, 960), (37, 53), (16, 1), (1536, 576), (5, 300)])
def test_panel_linear_matches_torch(ops, threads, k, n):
    """Every row-block size (1-8 rows, and several blocks), partial last panels, bias and residual."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(k * 1000 + n)
        w, bias = torch.randn(k, n, generator=gen), torch.randn(n, generator=gen)
        panels = kernels.pack_panels(w)
        assert panels.shape == (-(-n // 32), k, 32)
        for m in (1, 2, 3, 5, 8, 9, 17, 40):
            x, residual = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
            expected = x @ w
            torch.testing.assert_close(ops.panel_linear(x, panels, n, EMPTY, EMPTY), expected, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(
                ops.panel_linear(x, panels, n, bias, residual), expected + bias + residual, rtol=1e-5, atol=1e-4
            )
        # the transposed view of a contiguous [n, k] matrix (the runner's storage) packs the same
        assert torch.equal(kernels.pack_panels(w.t().contiguous().t()), panels)
    finally:
        torch.set_num_threads(previous)


def bf16_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w with both rounded to bfloat16 (nearest even), summed in float64: what the bf16 panels compute, up to
    their float32 sums."""
    return (x.bfloat16().double() @ w.bfloat16().double()).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k, n", [(576, 960), (37, 53), (1, 1), (1536, 576), (5, 300)])
def test_bf16_panel_linear_sums_the_bf16_products(ops, threads, k, n):
    """bfloat16 panels: every row-block size, odd K (a zero-padded last pair), partial last panels, bias and
    residual added in float32; the products are those of bf16-rounded x and W, summed in float32."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(k * 1000 + n + 7)
        w, bias = torch.randn(k, n, generator=gen), torch.randn(n, generator=gen)
        panels = kernels.pack_panels(w, torch.bfloat16)
        assert panels.shape == (-(-n // 32), -(-k // 2), 64) and panels.dtype == torch.bfloat16
        # the layout: panel p, row i holds columns 32p..32p+31 of inputs 2i and 2i + 1 in pairs
        p, i, c = (n - 1) // 32, (k - 1) // 2, (n - 1) % 32
        assert panels[p, i, 2 * c + (k - 1) % 2] == w[k - 1, n - 1].bfloat16()
        tolerance = dict(rtol=1e-5, atol=1e-4 * max(1.0, k**0.5 / 8))
        for m in (1, 2, 3, 5, 8, 9, 17, 40):
            x, residual = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
            expected = bf16_products(x, w)
            torch.testing.assert_close(ops.panel_linear(x, panels, n, EMPTY, EMPTY), expected, **tolerance)
            torch.testing.assert_close(
                ops.panel_linear(x, panels, n, bias, residual), expected + bias + residual, **tolerance
            )
        # the float32 result differs by the rounding of x and W: the test above would notice float32 products
        x = torch.randn(4, k, generator=gen)
        assert not torch.allclose(ops.panel_linear(x, panels, n, EMPTY, EMPTY), x @ w, rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def amx(ops):
    if not ops.amx_tiles_ready():
        pytest.skip("no AMX tiles here (CPU, build or OS): float32 matrices run on float32 panels")
    return ops


def split_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w with w to 16 significant bits (bf16 hi + bf16 lo), in float64: what the split panels compute, up to
    their float32 sums."""
    hi = w.bfloat16().float()
    return (x.double() @ (hi.double() + (w - hi).bfloat16().double())).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k, n", [(576, 960), (37, 53), (16, 1), (1536, 576), (5, 300)])
def test_split_panel_linear_sums_exact_products_of_16_bit_weights(amx, threads, k, n):
    """Split panels (AMX tiles): one tile of 1-16 rows, several tiles with zero-padded rows, K and n padded to whole
    steps and blocks, bias and residual; the result is x @ W with each weight to 16 significant bits, summed in
    float32, and each row's result is the one it gets alone."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(k * 1000 + n + 3)
        w, bias = torch.randn(k, n, generator=gen), torch.randn(n, generator=gen)
        panels = kernels.pack_split_panels(w)
        assert panels.shape == (-(-n // 16), -(-k // 32), 2, 16, 32) and panels.dtype == torch.int16
        # the layout: block b, step s, part (hi, lo), pair row i, column c, input 2i + e of the step
        b, s, i, c, e = (n - 1) // 16, (k - 1) // 32, (k - 1) % 32 // 2, (n - 1) % 16, (k - 1) % 2
        hi = panels[b, s, 0, i, 2 * c + e].view(torch.bfloat16).float()
        lo = panels[b, s, 1, i, 2 * c + e].view(torch.bfloat16).float()
        assert hi == w[k - 1, n - 1].bfloat16().float() and (hi + lo - w[k - 1, n - 1]).abs() <= 2**-16 * hi.abs()
        tolerance = dict(rtol=1e-5, atol=1e-5 * max(1.0, k**0.5 / 8))
        for m in (1, 2, 5, 16, 17, 40):
            x, residual = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
            expected = split_products(x, w)
            out = amx.panel_linear(x, panels, n, EMPTY, EMPTY)
            torch.testing.assert_close(out, expected, **tolerance)
            torch.testing.assert_close(
                amx.panel_linear(x, panels, n, bias, residual), expected + bias + residual, **tolerance
            )
            alone = torch.cat([amx.panel_linear(x[r : r + 1].contiguous(), panels, n, EMPTY, EMPTY) for r in range(m)])
            assert torch.equal(out, alone)
        # weights to 16 bits, not 24: the float32 products differ, by far less than bf16 ones
        x = torch.randn(4, k, generator=gen)
        out = amx.panel_linear(x, panels, n, EMPTY, EMPTY)
        assert (out - x @ w).abs().max() < (bf16_products(x, w) - x @ w).abs().max() / 16
    finally:
        torch.set_num_threads(previous)


def test_split_panels_reject_what_they_cannot_compute(amx):
    panels = kernels.pack_split_panels(torch.randn(40, 20))  # 2 steps of 32 inputs, 2 blocks of 16 columns
    assert panels.shape == (2, 2, 2, 16, 32)
    with pytest.raises(RuntimeError, match="x has 70 columns, the split panels 2 steps"):
        amx.panel_linear(torch.randn(3, 70), panels, 20, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match="does not match 2 blocks"):
        amx.panel_linear(torch.randn(3, 40), panels, 40, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match=r"\[B, S, 2, 16, 32\] int16"):
        amx.panel_linear(torch.randn(3, 40), panels.view(2, 2, 2, 32, 16), 20, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match="residual must be"):
        amx.panel_linear(torch.randn(3, 40), panels, 20, EMPTY, torch.randn(2, 20))
    with pytest.raises(ValueError, match=r"a \[K, N\] matrix"):
        kernels.pack_split_panels(torch.randn(4, 4, 4))


@pytest.mark.slow
def test_bf16_panels_without_bf16_dot_products_sum_the_same(ops, tmp_path, monkeypatch):
    """Built for a CPU without AVX-512 bf16 dot products (DDTREE_KERNEL_CFLAGS=-mno-avx512bf16: the portable loop),
    the bfloat16 panels give bit for bit the sums of vdpbf16ps: the pairs' order, and the flushing of subnormal
    inputs, products and sums to zero. Both builds leave out AMX (-mno-amx-bf16 -mno-amx-tile), whose tiles sum the
    same products with other roundings (test_bf16_panel_linear_sums_the_bf16_products covers them)."""
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX-512 bf16 dot products: the default build is the portable loop already")
    monkeypatch.setenv("DDTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    builds = {}
    for name, flags in (("dot products", ""), ("portable", "-mno-avx512bf16")):
        monkeypatch.setenv("DDTREE_KERNEL_CFLAGS", f"{flags} -mno-amx-bf16 -mno-amx-tile")
        monkeypatch.setattr(kernels, "_loaded", {})
        builds[name] = kernels.cpu_ops()
        assert builds[name] is not None and builds[name] is not ops and not builds[name].amx_tiles_ready()
    assert builds["dot products"].has_bf16_dot_products() and not builds["portable"].has_bf16_dot_products()
    portable, ops = builds["portable"], builds["dot products"]
    gen = torch.Generator().manual_seed(5)

    def wide(*shape, low=-30, high=30):  # random signs and mantissas over exponents 2^low .. 2^high
        sign = torch.randn(*shape, generator=gen).sign()
        return (
            sign
            * (1 + torch.rand(*shape, generator=gen))
            * torch.exp2(torch.randint(low, high, shape, generator=gen).float())
        )

    cases = [
        (torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen))
        for k, n, m in [(576, 1000, 8), (37, 53, 3), (1536, 576, 17), (100, 40, 40), (64, 33, 16)]
    ]
    cases.append((wide(9, 300), wide(300, 70)))  # cancellations across magnitudes
    cases.append((wide(2, 64, low=-75, high=-55), wide(64, 32, low=-75, high=-55)))  # products below 2^-126
    cases.append((torch.full((1, 2), 1e-39), torch.ones(2, 32)))  # a subnormal input
    for x, w in cases:
        panels = kernels.pack_panels(w, torch.bfloat16)
        n = w.shape[1]
        assert torch.equal(
            portable.panel_linear(x, panels, n, EMPTY, EMPTY), ops.panel_linear(x, panels, n, EMPTY, EMPTY)
        )


def test_linear_ops_reject_what_they_cannot_compute(ops):
    panels = kernels.pack_panels(torch.randn(8, 40))  # 2 panels
    with pytest.raises(RuntimeError, match="does not match"):
        ops.panel_linear(torch.randn(3, 8), panels, 70, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match="8 rows"):
        ops.panel_linear(torch.randn(3, 9), panels, 40, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.panel_linear(torch.randn(3, 8), panels, 40, EMPTY, torch.randn(2, 40))
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.panel_linear(torch.randn(3, 8).double(), panels, 40, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match="panels must be float32, bfloat16 or split"):
        ops.panel_linear(torch.randn(3, 8), panels.double(), 40, EMPTY, EMPTY)
    bf16_panels = kernels.pack_panels(torch.randn(9, 40), torch.bfloat16)  # 5 pairs of inputs
    assert bf16_panels.shape == (2, 5, 64)
    with pytest.raises(RuntimeError, match="x has 8 columns, the bfloat16 panels 5 rows"):
        ops.panel_linear(torch.randn(3, 8), bf16_panels, 40, EMPTY, EMPTY)
    with pytest.raises(RuntimeError, match=r"\[P, ceil\(K / 2\), 64\] bfloat16"):
        ops.panel_linear(torch.randn(3, 9), bf16_panels.view(2, 10, 32), 40, EMPTY, EMPTY)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.pack_panels(torch.randn(8, 40), torch.float16)


def test_rms_norm_and_silu_and_mul_match_torch(ops):
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 576, generator=gen) * 7, torch.randn(576, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    gate_up = torch.randn(3, 2 * 1536, generator=gen) * 4
    gate_up[0, :9] = torch.tensor(
        [-200.0, -90.0, -87.5, 87.5, 90.0, 200.0, -float("inf"), float("inf"), float("nan")]
    )  # past the exp's clamps, and what torch makes of inf and NaN
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], equal_nan=True)
    with pytest.raises(RuntimeError, match="rms_norm"):
        ops.rms_norm(x, torch.randn(5), 1e-5)
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        ops.silu_and_mul(torch.randn(2, 5))


@pytest.mark.parametrize(
    "heads, kv_heads, num_cached, num_new, is_tree, d",
    [
        (9, 3, 128, 1, False, 64),
        (4, 4, 0, 1, False, 64),
        (6, 2, 17, 5, False, 64),
        (6, 2, 0, 7, False, 64),
        (9, 3, 40, 8, True, 64),
        (4, 2, 3, 1, True, 64),
        (9, 3, 1008, 16, True, 64),
        (6, 2, 1023, 1, False, 64),
        (9, 3, 128, 33, True, 64),
        (9, 3, 300, 129, True, 64),
        (9, 3, 0, 130, False, 64),
        (9, 3, 31, 70, False, 64),
        (4, 2, 20, 9, True, 128),
        (4, 2, 20, 9, False, 48),
        (4, 2, 5, 3, True, 16),  # head_dim past / short of 32s
    ],
)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_block_ropes_writes_the_cache_and_attends(
    ops, heads, kv_heads, num_cached, num_new, is_tree, d, qk_norm, threads
):
    """(Qwen3's per-head q/k RMSNorm,) rotary, the KV write into the cache views and attention (causal, or a tree's
    ancestor mask) against torch's norm, rotary and SDPA."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_attention_block(ops, heads, kv_heads, num_cached, num_new, is_tree, d, qk_norm)
    finally:
        torch.set_num_threads(previous)


def _check_attention_block(ops, heads, kv_heads, num_cached, num_new, is_tree, d, qk_norm):
    slots, start = 1100, 40
    gen = torch.Generator().manual_seed(heads + num_cached + num_new)
    pool = torch.randn(2, kv_heads, slots, d, generator=gen)  # like one layer of the KV pool: strided views
    qkv = torch.randn(num_new, (heads + 2 * kv_heads) * d, generator=gen)
    angle = torch.rand(num_new, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angle, angle], dim=-1).cos(), torch.cat([angle, angle], dim=-1).sin()
    t = num_cached + num_new
    if is_tree:  # a random tree: every node sees the cache, its ancestors and itself
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, num_new)]
        mask = torch.zeros(num_new, t, dtype=torch.bool)
        mask[:, :num_cached] = True
        for i in range(num_new):
            j = i
            while j >= 0:
                mask[i, num_cached + j] = True
                j = parents[j]
    else:
        mask = torch.ones(num_new, t, dtype=torch.bool).tril(num_cached)  # causal
    q, k_new, v_new = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    eps = 1e-6
    norm_weights = (torch.rand(heads + kv_heads, d, generator=gen) + 0.5) if qk_norm else EMPTY
    if qk_norm:  # q_norm rows per q head, then k_norm rows per kv head
        q = (F.rms_norm(q.view(num_new, heads, d), (d,), eps=eps) * norm_weights[:heads]).reshape(num_new, -1)
        k_new = (F.rms_norm(k_new.view(num_new, kv_heads, d), (d,), eps=eps) * norm_weights[heads:]).reshape(
            num_new, -1
        )
    q = rope_reference(q.view(num_new, heads, d), cos.unsqueeze(1), sin.unsqueeze(1))
    k_new = rope_reference(k_new.view(num_new, kv_heads, d), cos.unsqueeze(1), sin.unsqueeze(1))
    k_ref = torch.cat([pool[0, :, start : start + num_cached], k_new.transpose(0, 1)], dim=1)
    v_ref = torch.cat([pool[1, :, start : start + num_cached], v_new.view(num_new, kv_heads, d).transpose(0, 1)], dim=1)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_ref.unsqueeze(0),
        v_ref.unsqueeze(0),
        attn_mask=mask,
        enable_gqa=heads != kv_heads,
    )
    expected = expected[0].transpose(0, 1).reshape(num_new, heads * d)
    untouched = pool.clone()
    k, v = pool[0, :, start : start + t], pool[1, :, start : start + t]
    out = ops.attention_block(qkv, cos, sin, k, v, mask if is_tree else EMPTY, heads, norm_weights, eps)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    new = slice(start + num_cached, start + t)
    torch.testing.assert_close(pool[0, :, new], k_new.transpose(0, 1))  # the new entries, roped
    torch.testing.assert_close(pool[1, :, new], v_new.view(num_new, kv_heads, d).transpose(0, 1))
    untouched[:, :, new] = pool[:, :, new]
    assert torch.equal(pool, untouched)  # nothing else written
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        ops.attention_block(qkv, cos, sin, k, v, EMPTY, heads + 1, EMPTY, eps)
    with pytest.raises(RuntimeError, match="mask must be"):
        ops.attention_block(qkv, cos, sin, k, v, torch.ones(num_new, t + 1, dtype=torch.bool), heads, EMPTY, eps)
    with pytest.raises(RuntimeError, match="qk_norm must be"):
        ops.attention_block(qkv, cos, sin, k, v, EMPTY, heads, torch.ones(heads, d), eps)
    if is_tree:  # a row that may see nothing (never in a valid tree) is zeros, as SDPA gives, not NaN
        blind = mask.clone()
        blind[0] = False
        out = ops.attention_block(qkv, cos, sin, k, v, blind, heads, norm_weights, eps)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()
    # a NaN query (a diverged model) gives NaN, as SDPA does, not a finite row (nor zeros) that hides it
    poisoned = qkv.clone()
    poisoned[num_new - 1, 0] = float("nan")  # head 0 of the last token
    out = ops.attention_block(poisoned, cos, sin, k, v, mask if is_tree else EMPTY, heads, EMPTY, eps)
    assert out[num_new - 1, :d].isnan().all()


@pytest.fixture(params=["float32 panels", "split panels"])
def float32_matrices(request, ops, monkeypatch):
    """The two ways a float32 target's matrices run on the native ops: float32 panels, and split panels (AMX)."""
    if request.param == "float32 panels":
        monkeypatch.setenv("DDTREE_AMX", "0")
    elif not ops.amx_tiles_ready():
        pytest.skip("no AMX tiles here: float32 matrices run on float32 panels")
    else:
        monkeypatch.delenv("DDTREE_AMX", raising=False)
    return request.param


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_one_token_forwards_on_native_ops_match_hf(tmp_path, family, ops, float32_matrices):
    """A single request decoded one token at a time (every forward takes the native path, from an empty cache
    on) gives Hugging Face's logits and features, and the torch path's within float32 rounding (on split panels:
    within the rounding of each weight to 16 significant bits)."""
    from transformers import AutoModelForCausalLM

    path = write_random_target(tmp_path / family, model_type=family, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    runners = {
        native: TargetModel.load(path, feature_layer_ids=[1, 0], max_kv_bytes=2**22, cpu_kernels=native)
        for native in (True, False)
    }
    assert runners[True].uses_cpu_kernels and not runners[False].uses_cpu_kernels
    assert runners[True].ops.uses_split_panels == (float32_matrices == "split panels")
    torch_tolerance = 1e-5 if float32_matrices == "float32 panels" else 1e-4
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    for runner in runners.values():
        runner.kv.allocate(0, 32)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    ref_feats = torch.cat([out.hidden_states[i + 1][0] for i in (1, 0)], dim=-1)
    for i, token in enumerate(ids):
        results = {}
        for native, runner in runners.items():
            logits, feats = runner.prefill([0], [[token]]) if i == 0 else runner.decode([0], [token])
            results[native] = (logits[0], feats[0] if i else feats[0][0])
        torch.testing.assert_close(results[True][0], out.logits[0, i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(results[True][1], ref_feats[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(results[True][0], results[False][0], rtol=torch_tolerance, atol=torch_tolerance)


@pytest.mark.parametrize(
    "weight_dtype, float32_matrices",
    [(torch.float32, "float32 panels"), (torch.float32, "split panels"), (torch.bfloat16, "float32 panels")],
    indirect=["float32_matrices"],
)
def test_a_tree_node_gets_exactly_the_logits_of_decoding_its_path(tmp_path, ops, weight_dtype, float32_matrices):
    """On the native ops every node of a packed batch of trees (siblings and cousins between its ancestors, several
    requests) gets bit-identical logits and features to decoding its path token by token: T=0 speculation is then
    exactly autoregressive decoding (with bf16 weights, whose input rounding would amplify any last-bit difference,
    too)."""
    from ddtree.models.testing import random_draft_tree
    from ddtree.packing import pack

    path = write_random_target(tmp_path / "t", seed=6, num_hidden_layers=2)
    runner = TargetModel.load(path, max_kv_bytes=2**22, feature_layer_ids=[0, 1], kernel_weight_dtype=weight_dtype)
    assert runner.uses_cpu_kernels and runner.kernel_weight_dtype == weight_dtype
    assert runner.ops.uses_split_panels == (float32_matrices == "split panels")
    gen = torch.Generator().manual_seed(1)
    vocab = runner.config.vocab_size
    contexts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (37, 50, 21)]
    trees = [random_draft_tree(n, 4, vocab, gen) for n in (12, 7, 15)]
    roots = [5, 9, 11]
    for r, context in enumerate(contexts):
        runner.kv.allocate(r, 128)
        runner.prefill([r], [context])
    packed = pack(trees, roots, [len(c) for c in contexts])
    logits, features = runner.verify([0, 1, 2], packed)
    probe = 99
    for r, (tree, context) in enumerate(zip(trees, contexts)):
        start = packed.query_starts[r]
        parents, ids = tree.parents.tolist(), tree.token_ids.tolist()
        for node in range(-1, len(ids)):  # -1: the root
            path, i = [], node
            while i >= 0:
                path.append(ids[i])
                i = parents[i]
            runner.kv.allocate(probe, 128)
            runner.prefill([probe], [context])
            for token in [roots[r]] + path[::-1]:
                decoded_logits, decoded_features = runner.decode([probe], [token])
            runner.free(probe)
            row = start + 1 + node
            assert torch.equal(logits[row], decoded_logits[0]), (r, node)
            assert torch.equal(features[row], decoded_features[0]), (r, node)


def test_kernels_are_on_by_default_only_on_x86_cpus_with_avx512_or_avx2(monkeypatch, tmp_path):
    """Unset or auto: on x86 CPUs with AVX-512, or AVX2 and FMA (the vector registers the tiles are sized for);
    1 forces them, 0 turns them off. (The CPU's flags are read once per process: each case reads them afresh.)"""
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(kernels, "_has_vector_units", kernels._has_vector_units.__wrapped__)
    real_path = kernels.Path

    def fake_path(p, *args):
        return cpuinfo if str(p) == "/proc/cpuinfo" else real_path(p, *args)

    monkeypatch.setattr(kernels, "Path", fake_path)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    cases = {
        "flags\t\t: fpu sse2 avx2 fma avx512f avx512bw\n": True,
        "flags\t\t: fpu sse2 avx2 fma\n": True,
        "flags\t\t: fpu sse2 avx2\n": False,
        "flags\t\t: fpu sse2 sse4_2\n": False,
    }
    for text, has_avx512 in cases.items():
        cpuinfo.write_text("processor\t: 0\n" + text)
        for value, enabled in (
            (None, has_avx512),
            ("auto", has_avx512),
            ("1", True),
            ("on", True),
            ("0", False),
            ("off", False),
        ):
            if value is None:
                monkeypatch.delenv("DDTREE_CPU_KERNELS", raising=False)
            else:
                monkeypatch.setenv("DDTREE_CPU_KERNELS", value)
            assert kernels.kernels_enabled() is enabled, (text, value)
    monkeypatch.delenv("DDTREE_CPU_KERNELS")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    assert not kernels.kernels_enabled()


def test_disabled_or_unbuildable_kernels_fall_back_to_torch(tmp_path, monkeypatch, caplog):
    path = write_random_target(tmp_path / "t", seed=2)
    monkeypatch.setenv("DDTREE_CPU_KERNELS", "0")
    assert kernels.cpu_ops() is None
    assert not TargetModel.load(path, max_kv_bytes=2**20).uses_cpu_kernels
    monkeypatch.delenv("DDTREE_CPU_KERNELS")

    # a source the compiler rejects, built into an empty cache: the warning carries the compiler's own error line
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "cpu_ops.cpp").write_text("#include <torch/extension.h>\n#include <no_such_header_ddtree.h>\n")
    monkeypatch.setattr(kernels, "SOURCE_DIR", broken)
    monkeypatch.setenv("DDTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="ddtree.kernels"):
        runner = TargetModel.load(path, max_kv_bytes=2**20)
    assert not runner.uses_cpu_kernels
    assert "native kernel cpu_ops unavailable" in caplog.text and "no_such_header_ddtree.h" in caplog.text
    # a compiler that is not there: the warning says so (the shell's "not found"), not only the command line
    assert "not found" in kernels._build_error(
        RuntimeError(
            "Error building extension 'x': [1/2] /nonexistent/c++ -MMD -c a.cpp -o a.o\n"
            "FAILED: a.o\n/bin/sh: 1: /nonexistent/c++: not found\nninja: build stopped: subcommand failed."
        )
    )
    # many compiler errors: the first (the cause) and the last are kept
    many = "\n".join(
        ["a.cpp:3:1: error: 'at::Tag' has not been declared"]
        + [f"a.cpp:{9 + i}:5: error: 'x{i}' was not declared" for i in range(6)]
    )
    kept = kernels._build_error(RuntimeError(many))
    assert "at::Tag" in kept and "'x5'" in kept and kept.count("|") == 4
    runner.kv.allocate(0, 8)
    logits, _ = runner.prefill([0], [[3]])  # still decodes, on torch's kernels
    assert logits.shape == (1, runner.config.vocab_size)


def round_linears_to_bf16(module) -> None:
    """Every nn.Linear in `module` computes with its input and weight rounded to bfloat16 (float32 results): what
    the bf16 panels compute, on torch's kernels."""
    for linear in [m for m in module.modules() if isinstance(m, torch.nn.Linear)]:
        weight = linear.weight.detach().bfloat16().float()
        linear.forward = lambda x, w=weight, b=linear.bias: F.linear(x.bfloat16().float(), w, b)


def test_drafter_on_native_ops_drafts_what_torch_drafts(tmp_path, ops):
    """The drafter's linears and draft-vocabulary head on the panel GEMM: float32 panels give the same top-k and
    log-probs as torch within float32 rounding; bfloat16 panels (the default) those of torch with every product's
    input and weight rounded to bf16; for batched requests with different context lengths."""
    from ddtree.drafter import DFlashDrafter
    from ddtree.models.dflash import save_draft_vocab
    from ddtree.models.testing import write_random_dflash

    target_dir = write_random_target(tmp_path / "target", num_hidden_layers=3, seed=4)
    target = TargetModel.load(target_dir, feature_layer_ids=[0, 2], max_kv_bytes=2**22)
    drafter_dir = write_random_dflash(
        tmp_path / "drafter", target.config, num_layers=2, block_size=6, target_layer_ids=[0, 2]
    )
    save_draft_vocab(drafter_dir, list(range(3, 90, 2)), source="test")
    drafters = {
        "f32": DFlashDrafter.load(drafter_dir, target, kernel_weight_dtype=torch.float32),
        "bf16": DFlashDrafter.load(drafter_dir, target, kernel_weight_dtype=torch.bfloat16),
        "torch": DFlashDrafter.load(drafter_dir, target, cpu_kernels=False),
        "torch bf16": DFlashDrafter.load(drafter_dir, target, cpu_kernels=False),
    }
    assert drafters["f32"].uses_cpu_kernels and drafters["bf16"].uses_cpu_kernels
    assert not drafters["torch"].uses_cpu_kernels
    # the default: bf16 panels where they run on bf16 dot products, float32 ones where they would be slower
    default_panels = DFlashDrafter.load(drafter_dir, target)._draft_lm_head.panels.dtype
    assert default_panels == (torch.bfloat16 if ops.has_bf16_dot_products() else torch.float32)
    reference = drafters["torch bf16"]
    round_linears_to_bf16(reference.model)
    head = reference._draft_lm_head  # [H, Vd]: as a linear whose products are rounded to bf16, as its panels do
    reference._draft_lm_head = torch.nn.Linear(head.shape[0], head.shape[1], bias=False)
    reference._draft_lm_head.weight.data = head.t().contiguous()
    round_linears_to_bf16(reference._draft_lm_head)
    gen = torch.Generator().manual_seed(0)
    for r, n in enumerate((9, 3, 14)):
        features = torch.randn(n, drafters["f32"].config.num_target_features, generator=gen)
        for drafter in drafters.values():
            drafter.add_context(r, features)
    drafts = {name: d.draft([0, 1, 2], [5, 17, 42], max_k=8) for name, d in drafters.items()}
    # bf16: each linear rounds its input to bf16, so where two float32 sums of an activation differ in the last bit
    # and straddle a rounding boundary, the next linear sees inputs 2^-9 apart (AMX tiles and torch's GEMM sum in
    # other orders): the log-probs agree to a few hundredths, the top-k exactly
    for native, torch_kernels, tolerance in (("f32", "torch", 1e-5), ("bf16", "torch bf16", 5e-2)):
        torch.testing.assert_close(drafts[native][0], drafts[torch_kernels][0], rtol=tolerance, atol=tolerance)
        assert torch.equal(drafts[native][1], drafts[torch_kernels][1])
    assert not torch.allclose(drafts["bf16"][0], drafts["f32"][0], rtol=1e-5, atol=1e-5)  # bf16 rounding shows
    assert set(drafts["bf16"][1].flatten().tolist()) <= set(range(3, 90, 2))


def test_a_build_killed_half_way_does_not_block_later_loads(ops, monkeypatch):
    """torch's build lock is a plain file: a builder killed mid-build leaves it, and torch would then wait for it
    forever. The loader holds its own flock (released when a process dies) and removes such a leftover."""
    import threading

    build_dir = kernels.build_directory("cpu_ops")
    assert any(build_dir.glob("*.so"))  # built by the `ops` fixture
    (build_dir / "lock").write_text("")  # what a killed builder leaves
    monkeypatch.setattr(kernels, "_loaded", {})
    result = {}
    loader = threading.Thread(target=lambda: result.setdefault("module", kernels.cpu_ops()), daemon=True)
    loader.start()
    loader.join(timeout=120)
    assert not loader.is_alive(), "the load waited on the stale lock"
    assert result["module"] is not None and not (build_dir / "lock").exists()


def test_native_ops_release_the_gil(ops):
    """Another Python thread (the Serve replica's event loop) runs while a native op computes."""
    import threading
    import time

    panels = kernels.pack_panels(torch.randn(1024, 4096))
    x = torch.randn(8, 1024)
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        start = time.perf_counter()
        calls = 0
        while time.perf_counter() - start < 0.3:
            ops.panel_linear(x, panels, 4096, EMPTY, EMPTY)
            calls += 1
    finally:
        stop.set()
        spinner.join()
    assert ticks[0] > 20 * calls  # holding the GIL, the spinner would get about one tick per call


def test_ninja_of_the_environment_is_put_on_path(monkeypatch):
    """torch finds ninja on PATH only: `.venv/bin/python` run without activating the environment has the `ninja`
    package's binary off PATH, so the build puts it there (without it torch refuses to build: a warning, no kernels)."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    kernels._put_ninja_on_path()
    assert shutil.which("ninja") is not None and shutil.which("ninja").startswith(ninja.BIN_DIR)


def test_bfloat16_on_a_cpu_is_bf16_panels_under_float32_activations(tmp_path, ops, monkeypatch):
    """dtype="bfloat16" on a CPU with the native ops: the target stores its matrices as bf16 panels and computes,
    caches and hands out features in float32; the drafter computes in float32 on its bf16 panels; the greedy output
    of a speculative engine equals `off` on that target. Without the native ops bfloat16 is torch's bfloat16."""
    from ddtree import LLM, SamplingParams
    from tests.factories import make_tiny_drafter, make_tiny_target

    if not ops.has_bf16_dot_products():
        pytest.skip("this build has no bf16 dot products: bfloat16 stays torch's (bf16 panels would be slower)")
    target_dir = make_tiny_target(tmp_path / "target", num_layers=2, logit_scale=4.0)
    drafter_dir = make_tiny_drafter(tmp_path / "drafter", target_dir)
    spec = LLM(str(target_dir), str(drafter_dir), dtype="bfloat16", budget=6)
    model = spec.engine.target.model
    drafter = spec.engine.drafter.drafter
    assert model.dtype == torch.float32 and model.kernel_weight_dtype == torch.bfloat16
    assert model.ops.panel_layers[0].panels["w_qkv"].dtype == torch.bfloat16
    assert model.ops.panel_lm_head.dtype == torch.bfloat16
    assert drafter.dtype == torch.float32 and drafter.uses_cpu_kernels
    off = LLM(str(target_dir), dtype="bfloat16", speculation="off")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = ["hello there", "abc abc abc", "the cat sat"]
    outputs = spec.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in off.generate(prompts, params)]
    assert sum(len(o.acceptance_lengths) for o in outputs) < 3 * 40  # it did speculate: fewer rounds than tokens

    with pytest.raises(ValueError, match="kernel_weight_dtype must be float32 or bfloat16"):
        TargetModel.load(target_dir, max_kv_bytes=2**20, kernel_weight_dtype=torch.float16)
    monkeypatch.setenv("DDTREE_CPU_KERNELS", "0")
    plain = LLM(str(target_dir), dtype="bfloat16", speculation="off").engine.target.model
    assert plain.dtype == torch.bfloat16 and not plain.uses_cpu_kernels


@pytest.mark.slow
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    """The kernels built for AVX2 (`-march=x86-64-v3`: 8-float vectors, tiles of 3 rows x 4 vectors; no bf16 dot
    products, no AMX tiles): the GEMM, attention, exactness and drafter tests of this file, run in a child pytest on
    that build (where the drafter defaults to float32 panels)."""
    import os
    import subprocess
    import sys

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not ({"avx2", "fma"} <= set(flags.split())):
        pytest.skip("this CPU cannot run AVX2 code")
    env = dict(
        os.environ,
        DDTREE_CPU_KERNELS="1",
        DDTREE_KERNEL_CFLAGS="-march=x86-64-v3",
        DDTREE_KERNEL_CACHE=str(tmp_path / "cache"),
    )
    # split panels need AMX tiles, which the AVX2 build leaves out: its float32 target runs on float32 panels
    selected = "(panel_linear or attention_block or exactly_the_logits or native_ops_drafts) and not split"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", selected],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
