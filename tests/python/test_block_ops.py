"""The fused transformer-block ops (issue 52): layer / RMS norm with and
without the residual add and a second output dtype, bias + GELU and SwiGLU,
through fusetrain.nn.functional and the modules, against torch's own
functions, forward and every gradient.

Tolerances (Note [Fused norms], Note [Fused activations]). The reference is
torch in float64 on the same (rounded) inputs. torch's own function in the
test's dtype is off from it by its own error, err_torch; ours must be within
twice that, or within one ulp of the output dtype at the output's largest
magnitude where torch's error is smaller than that (an fp32 statistic and a
single rounding of the result cost up to about one ulp; torch's float32
paths sometimes land closer). Weight and bias gradients are sums over the
rows: their floor is one float32 ulp per row block of the sum of the terms'
magnitudes (fp32 blocks of 32 rows, then float64).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fusetrain.nn
import fusetrain.nn.functional as FF

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
WIDTHS = [1, 7, 17, 64, 100, 768, 1000]


def rnd(shape, dtype, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


def check(ours, torch_same, ref, what, floor=None):
    """max |ours - ref| <= max(2 max |torch_same - ref|, floor); the floor is
    one ulp of ours' dtype at max |ref| unless given; NaN/inf where ref has
    them."""
    assert ours.shape == ref.shape, what
    assert ours.dtype == torch_same.dtype, f"{what}: dtype {ours.dtype} != torch's {torch_same.dtype}"
    o, t, r = ours.double(), torch_same.double(), ref.double()
    finite = torch.isfinite(r)
    assert torch.equal(torch.isfinite(o), finite), f"{what}: non-finite where torch's is not"
    if r.numel() == 0:
        return
    err_ours = (o - r)[finite].abs().max().item() if finite.any() else 0.0
    err_torch = (t - r)[finite].abs().max().item() if finite.any() else 0.0
    if floor is None:
        floor = ULP[ours.dtype] * r[finite].abs().max().item()
    bound = max(2 * err_torch, floor)
    assert err_ours <= bound, f"{what}: max error {err_ours:.3g}, torch's {err_torch:.3g}, bound {bound:.3g}"


def sum_floor(terms: torch.Tensor, dtype: torch.dtype) -> float:
    """A column sum's error bound: the float32 sums of a 32-row block are off
    by up to 32 ulps of their terms' magnitude sum (a float64 sum of the
    blocks follows), then one rounding to the gradient's dtype."""
    mags = terms.double().abs().sum(0)
    return (mags * 32 * 2.0**-24).max().item() + ULP[dtype] * terms.double().sum(0).abs().max().item()


def leaf(t):
    return t.detach().clone().requires_grad_()


def norm_case(kind, shape, dtype, residual, affine=True, seed=0):
    width = shape[-1]
    x = rnd(shape, dtype, seed, 2.0, 3.0)  # offset mean: the sums must not cancel
    r = rnd(shape, dtype, seed + 1) if residual else None
    w = rnd((width,), dtype, seed + 2, 0.5, 1.0) if affine else None
    b = rnd((width,), dtype, seed + 3) if affine and kind == "layer" else None
    gy = rnd(shape, dtype, seed + 4)
    gs = rnd(shape, dtype, seed + 5) if residual else None
    return x, r, w, b, gy, gs


def run_norm(kind, impl, x, r, w, b, gy, gs, width, eps):
    """Forward + backward of one implementation: impl is "ours", "torch" or
    "ref" (torch in float64 of the rounded inputs)."""
    dt = torch.float64 if impl == "ref" else x.dtype
    xs, rs, ws, bs = (None if t is None else leaf(t.to(dt)) for t in (x, r, w, b))
    if impl == "ours":
        if r is not None:
            fn = FF.add_layer_norm if kind == "layer" else FF.add_rms_norm
            args = (xs, rs, [width], ws) + ((bs, eps) if kind == "layer" else (eps,))
            out, s = fn(*args)
        else:
            out = (FF.layer_norm(xs, [width], ws, bs, eps) if kind == "layer"
                   else FF.rms_norm(xs, [width], ws, eps))
            s = None
    else:
        s = None
        if r is not None:
            # The unfused sum, rounded to the input dtype as eager rounds it.
            s = xs + rs if impl == "torch" else (xs + rs)
        v = s if s is not None else xs
        if impl == "ref" and r is not None:
            v = v + ((x.double() + r.double()).to(x.dtype).double() - v).detach()  # the rounded sum
        out = (F.layer_norm(v, [width], ws, bs, eps) if kind == "layer"
               else F.rms_norm(v, [width], ws, eps))
    loss = (out * gy.to(out.dtype)).sum()
    if s is not None:
        loss = loss + (s * gs.to(s.dtype)).sum()
    loss.backward()
    grads = {"input": xs.grad}
    if r is not None:
        grads["residual"] = rs.grad
    if w is not None:
        grads["weight"] = ws.grad
    if b is not None:
        grads["bias"] = bs.grad
    return out.detach(), (None if s is None else s.detach()), grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("width", WIDTHS)
def test_norm_matches_torch(kind, dtype, residual, width):
    rows = 67
    case = norm_case(kind, (rows, width), dtype, residual)
    eps = 1e-5
    ours = run_norm(kind, "ours", *case, width, eps)
    theirs = run_norm(kind, "torch", *case, width, eps)
    ref = run_norm(kind, "ref", *case, width, eps)
    what = f"{kind} {dtype} width {width} residual {residual}"
    check(ours[0], theirs[0], ref[0], what + " out")
    if residual:
        assert torch.equal(ours[1], theirs[1]), what + ": the sum must be eager's x + r bit for bit"
    for name, g in ours[2].items():
        if name in ("weight", "bias"):
            # The terms: grad_out * xhat (|xhat| <= sqrt(width)) and grad_out.
            gy = case[4].double()
            terms = gy * (width**0.5 if name == "weight" else 1.0)
            check(g, theirs[2][name], ref[2][name], f"{what} grad {name}", floor=sum_floor(terms, g.dtype))
        else:
            check(g, theirs[2][name], ref[2][name], f"{what} grad {name}")


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_out_dtype_rounds_once(kind):
    """float32 residual stream, bfloat16 output for the next GEMM: the output
    is the float32 result rounded once."""
    x, r, w, b, _, _ = norm_case(kind, (9, 300), torch.float32, True)
    if kind == "layer":
        out, s = FF.add_layer_norm(x, r, 300, w, b, out_dtype=torch.bfloat16)
        full, s32 = FF.add_layer_norm(x, r, 300, w, b)
    else:
        out, s = FF.add_rms_norm(x, r, 300, w, 1e-6, out_dtype=torch.bfloat16)
        full, s32 = FF.add_rms_norm(x, r, 300, w, 1e-6)
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(out, full.to(torch.bfloat16))
    assert torch.equal(s, s32)


def test_norm_noncontiguous_3d_and_zero_rows():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(5, 40, 6, generator=g)
    x = base.transpose(1, 2)  # [5, 6, 40], not contiguous
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(FF.layer_norm(x, [40], w, b), F.layer_norm(x, [40], w, b), rtol=0, atol=3e-6)
    torch.testing.assert_close(FF.rms_norm(x, [6, 40][1:], w), F.rms_norm(x, [40], w), rtol=0, atol=3e-6)
    # Two normalised dimensions.
    y = torch.randn(3, 4, 5, generator=g)
    w2 = torch.randn(4, 5, generator=g)
    torch.testing.assert_close(FF.layer_norm(y, [4, 5], w2), F.layer_norm(y, [4, 5], w2), rtol=0, atol=3e-6)
    # Zero rows: empty outputs, empty gradients.
    z = torch.zeros(0, 40, requires_grad=True)
    wz = w.clone().requires_grad_()
    out = FF.layer_norm(z, [40], wz, b)
    out.sum().backward()
    assert out.shape == (0, 40) and z.grad.shape == (0, 40) and torch.equal(wz.grad, torch.zeros(40))


def test_modules_are_torchs():
    ln = fusetrain.nn.LayerNorm(48)
    rms = fusetrain.nn.RMSNorm([48], eps=1e-6)
    assert isinstance(ln, torch.nn.LayerNorm) and isinstance(rms, torch.nn.RMSNorm)
    ref_ln, ref_rms = torch.nn.LayerNorm(48), torch.nn.RMSNorm([48], eps=1e-6)
    ref_ln.load_state_dict(ln.state_dict())
    ref_rms.load_state_dict(rms.state_dict())
    x = torch.randn(7, 48)
    torch.testing.assert_close(ln(x), ref_ln(x), rtol=0, atol=3e-6)
    torch.testing.assert_close(rms(x), ref_rms(x), rtol=0, atol=3e-6)
    # float64 goes to torch's own.
    assert torch.equal(ln.double()(x.double()), F.layer_norm(x.double(), [48], ln.weight, ln.bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gelu_matches_torch(dtype, approximate, with_bias):
    for width in (7, 100, 1000):
        x = rnd((33, width), dtype, 1, 3.0)
        b = rnd((width,), dtype, 2) if with_bias else None
        gy = rnd((33, width), dtype, 3)

        def run(impl):
            dt = torch.float64 if impl == "ref" else dtype
            xs = leaf(x.to(dt))
            bs = None if b is None else leaf(b.to(dt))
            if impl == "ours":
                y = FF.gelu(xs, approximate, bias=bs)
            else:
                v = xs if bs is None else xs + bs
                if impl == "ref" and bs is not None:  # the sum rounded as eager rounds it
                    v = v + ((x.double() + b.double()).to(dtype).double() - v).detach()
                y = F.gelu(v, approximate=approximate)
            (y * gy.to(dt)).sum().backward()
            return y.detach(), xs.grad, None if bs is None else bs.grad

        ours, theirs, ref = run("ours"), run("torch"), run("ref")
        what = f"gelu {approximate} {dtype} width {width} bias {with_bias}"
        check(ours[0], theirs[0], ref[0], what)
        check(ours[1], theirs[1], ref[1], what + " grad input")
        if with_bias:
            check(ours[2], theirs[2], ref[2], what + " grad bias", floor=sum_floor(ref[1], dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("two_inputs", [False, True])
def test_swiglu_matches_torch(dtype, two_inputs):
    for width in (1, 9, 64, 1000):
        a = rnd((21, 2 * width if not two_inputs else width), dtype, 4, 3.0)
        b = rnd((21, width), dtype, 5) if two_inputs else None
        gy = rnd((21, width), dtype, 6)

        def run(impl):
            dt = torch.float64 if impl == "ref" else dtype
            av = leaf(a.to(dt))
            bv = None if b is None else leaf(b.to(dt))
            if impl == "ours":
                y = FF.swiglu(av, bv)
            else:
                gate, up = (av, bv) if bv is not None else av.chunk(2, -1)
                y = F.silu(gate) * up
            (y * gy.to(dt)).sum().backward()
            return y.detach(), av.grad, None if bv is None else bv.grad

        ours, theirs, ref = run("ours"), run("torch"), run("ref")
        what = f"swiglu {dtype} width {width} two inputs {two_inputs}"
        check(ours[0], theirs[0], ref[0], what)
        check(ours[1], theirs[1], ref[1], what + " grad a")
        if two_inputs:
            check(ours[2], theirs[2], ref[2], what + " grad b")


def test_activations_noncontiguous_and_extremes():
    # Against float64 forms accurate in the tails (torch's float64 gelu
    # cancels to -0 below -8): x ndtr(x), and x sigmoid(2u) for the tanh form.
    # The exact form's erfc (Abramowitz-Stegun 7.1.26, as torch's vectorised
    # erf) is off by up to 1.5e-7 absolute, so x/2 times that; +inf gives
    # +inf (torch's CPU kernel: NaN).
    x = torch.tensor([[-1e4, -40.0, -10.0, -5.0, -0.0, 0.0, 1e-30, 0.3, 10.0, 1e4, float("inf"), float("nan")]])
    xd = x.double()
    refs = {"none": xd * torch.special.ndtr(xd),
            "tanh": xd * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3))}
    for ap, ref in refs.items():
        ours = FF.gelu(x, ap).double()
        ref = torch.where(xd == math.inf, xd, ref)
        assert torch.equal(ours.isnan(), ref.isnan()), ap
        keep = ref.isfinite()
        assert torch.equal(ours[ref.isinf()], ref[ref.isinf()]), ap
        # exp's argument (u2, or x^2 / 2) carries a relative rounding of
        # 2^-24, so e^arg is off by |arg| 2^-24 relative; below 1e-36 the
        # float32 exp underflows to 0 (e^-86).
        arg = xd**2 / 2 if ap == "none" else 2 * math.sqrt(2 / math.pi) * (xd.abs() + 0.044715 * xd.abs() ** 3)
        slack = (4e-7 + arg * 2**-23) * ref.abs() + (7.5e-8 * xd.abs() if ap == "none" else 0) + 1e-36
        assert ((ours - ref).abs()[keep] <= slack[keep]).all(), (ap, ours, ref)
    s = FF.swiglu(x[:, :9], torch.ones(1, 9))
    torch.testing.assert_close(s.double(), F.silu(x[:, :9].double()), rtol=2e-7, atol=1e-37)
    base = torch.randn(16, 30)
    nc = base.t()
    torch.testing.assert_close(FF.swiglu(nc), F.silu(nc[:, :8]) * nc[:, 8:], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(FF.gelu(nc, bias=torch.ones(16)), F.gelu(nc + 1), rtol=2e-6, atol=1e-7)


def test_errors_name_the_argument():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must have the normalized_shape"):
        FF.layer_norm(x, [8], torch.ones(7))
    with pytest.raises(RuntimeError, match=r"expected input of shape \[\*, \[6\]\]"):
        FF.rms_norm(x, [6])
    with pytest.raises(RuntimeError, match="residual must have the input's shape"):
        FF.add_layer_norm(x, torch.randn(4, 7), [8])
    with pytest.raises(RuntimeError, match="bias must be 1-D with the input's last dimension"):
        FF.gelu(x, bias=torch.ones(3))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        FF.gelu(x, "erf")
    with pytest.raises(RuntimeError, match="must be even"):
        FF.swiglu(torch.randn(4, 7))


def test_compile_fullgraph_matches_eager():
    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    up = torch.randn(64, 128, generator=g)

    def block(x, r, w, b, up):
        h, s = FF.add_layer_norm(x, r, 64, w, b)
        m = FF.swiglu(h @ up)
        return FF.rms_norm(FF.gelu(m, "tanh"), [64], w) , s

    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        args = [leaf(t) for t in (x, r, w, b, up)]
        out, s = fn(*args)
        (out.square().sum() + s.sum()).backward()
        results.append([out.detach(), s.detach()] + [a.grad for a in args])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


PATHS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import fusetrain.nn.functional as FF
    from fusetrain import _C
    torch.set_num_threads(2)
    out = {"path": _C.cpu_features()["path"]}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for width in (7, 40, 1000):
            x = (torch.randn(70, width, generator=g) * 2 + 1).to(dtype).requires_grad_()
            r = torch.randn(70, width, generator=g).to(dtype).requires_grad_()
            w = torch.randn(width, generator=g).requires_grad_()
            b = torch.randn(width, generator=g).requires_grad_()
            y, s = FF.add_layer_norm(x, r, width, w, b)
            z = FF.rms_norm(s, width, w)
            (y.float().square().sum() + z.float().sum()).backward()
            out[f"norm {dtype} {width}"] = [y, s, z, x.grad, r.grad, w.grad, b.grad]
            a = (torch.randn(70, 2 * width, generator=g) * 3).to(dtype).requires_grad_()
            bb = torch.randn(width, generator=g).to(dtype).requires_grad_()
            act = [FF.swiglu(a)] + [FF.gelu(a, ap, bias=torch.cat([bb, bb])) for ap in ("none", "tanh")]
            sum(t.float().sum() for t in act).backward()
            out[f"act {dtype} {width}"] = act + [a.grad, bb.grad]
        for interleaved in (False, True):
            q = torch.randn(2, 3, 11, 40, generator=g).to(dtype).requires_grad_()
            angles = torch.randn(11, 17, generator=g)
            qo, _ = FF.apply_rotary(q, None, angles.cos(), angles.sin(), interleaved=interleaved)
            (qo.float() * torch.arange(40.0)).sum().backward()
            out[f"rotary {dtype} {interleaved}"] = [qo, q.grad]
    torch.save({k: v if isinstance(v, str) else [t.detach() for t in v] for k, v in out.items()}, sys.argv[1])
    """
)


def run_path(path, tmp_path):
    target = tmp_path / f"{path or 'default'}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("FUSETRAIN_CPU_PATH", "ATEN_CPU_CAPABILITY")}
    if path:
        env["FUSETRAIN_CPU_PATH"] = path
    p = subprocess.run([sys.executable, "-c", PATHS_SCRIPT, str(target)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(target)


def test_every_cpu_path_agrees(tmp_path):
    """Each lower path (scalar loops, AVX2, the ATen composition) against the
    default: the activations' outputs bit for bit between the two vector
    paths (every element through the same vector code); everything within a
    few ulps of the dtype elsewhere (reduction order, the scalar loops' libm)."""
    from fusetrain import _C

    default = run_path(None, tmp_path)
    best = default["path"]
    for path in [p for p in ("generic", "scalar", "avx2") if p != best]:
        other = run_path(path, tmp_path)
        for key, tensors in default.items():
            if key == "path":
                continue
            for i, (a, b) in enumerate(zip(tensors, other[key])):
                if key.startswith("act") and i < 3 and {path, best} == {"avx2", "avx512"}:
                    assert torch.equal(a, b), f"{path}: {key}[{i}] differs from {best}"
                else:
                    tol = 8 * ULP[a.dtype] if a.dtype != torch.float32 else 3e-5
                    torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item(),
                                               msg=lambda m: f"{path} vs {best}: {key}[{i}]: {m}")


# ------------------------------------------------------------- the CLI's models


@pytest.mark.parametrize("model", ["gpt", "gpt2", "llama"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_cli_models_same_loss_curve_fused_or_not(tmp_path, model, policy):
    """model.fused_block_ops (the default) against torch's ops: the same loss
    at every step of a run. The two differ only in float32 rounding (the
    norms' sums, one rounding of a norm's output) in float32, and in bf16
    roundings of the GEMM inputs (the norm writes bf16 once; autocast's cast
    of a float32 norm output rounds the same value) and of a bias + GELU
    (bf16 GEMM then fp32 bias, against a bf16 addmm) in mixed_bfloat16: over
    20 steps at lr 3e-3, 1e-4 and 2e-2 of the loss."""
    from trainer_cli import BIN, ok, records, run

    if not BIN.exists():
        pytest.skip(f"{BIN} is missing: build it first (make build)")
    common = ("--nproc", "1", "--threads", "1", "--set", "output.curves=false",
              "--set", "data.name=synthetic_tokens", "--set", f"model.name={model}",
              "--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4",
              "--set", "model.seq_len=32", "--set", "data.batch_size=8", "--set", "train.max_steps=20",
              "--set", "train.log_every=1", "--set", f"precision.policy={policy}",
              "--set", "optimizer.lr=0.003", "--set", "schedule.warmup_steps=0", "--set", "train.seed=0")
    losses = {}
    for fused in ("true", "false"):
        run_dir = tmp_path / fused
        ok(run("train", "--run-dir", run_dir, *common, "--set", f"model.fused_block_ops={fused}"))
        losses[fused] = torch.tensor([r["loss"] for r in records(run_dir, "train")], dtype=torch.float64)
    fused, unfused = losses["true"], losses["false"]
    assert len(fused) == 20 and fused[-1] < fused[0] - 0.05, fused  # it trains
    tol = 1e-4 if policy == "float32" else 2e-2
    assert ((fused - unfused).abs() <= tol * unfused.abs()).all(), (fused, unfused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_eps_where_it_matters(dtype):
    """Rows whose variance is below eps (and a constant row): eps, and
    rms_norm's default eps (the dtype's machine epsilon, torch's), set the
    scale there."""
    x = rnd((5, 64), dtype, 9, 1e-3, 0.5)
    x[2] = 0.25
    w = rnd((64,), dtype, 10)
    for eps in (1e-5, 1e-2):
        check(FF.layer_norm(x, 64, w, None, eps), F.layer_norm(x, [64], w, None, eps),
              F.layer_norm(x.double(), [64], w.double(), None, eps), f"layer eps {eps}")
    for eps in (None, 1e-2):
        ref_eps = torch.finfo(dtype).eps if eps is None else eps
        check(FF.rms_norm(x * 1e-2, 64, w, eps), F.rms_norm(x * 1e-2, [64], w, eps),
              F.rms_norm((x * 1e-2).double(), [64], w.double(), ref_eps), f"rms eps {eps}")


# ------------------------------------------------------------------ rotary


def rope_tables(positions, rot_dim, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    return angles.cos(), angles.sin()  # [S, rot_dim / 2]


def rope_reference(x, cos, sin, interleaved):
    """The unfused forms: Hugging Face's rotate_half over [cos, cos] tables,
    or Meta's complex product of consecutive pairs."""
    rot = 2 * cos.size(-1)
    head, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        pairs = torch.view_as_complex(head.double().unflatten(-1, (-1, 2)).contiguous())
        out = torch.view_as_real(pairs * torch.polar(torch.ones_like(cos.double()), torch.atan2(sin, cos).double()))
        out = out.flatten(-2).to(x.dtype)
    else:
        c, s = torch.cat([cos, cos], -1).to(x.dtype), torch.cat([sin, sin], -1).to(x.dtype)
        half = rot // 2
        rotate_half = torch.cat([-head[..., half:], head[..., :half]], -1)
        out = head * c + rotate_half * s
    return torch.cat([out, rest], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("rot_dim", [64, 32, 24])
def test_rotary_matches_the_unfused_forms(dtype, interleaved, layout, rot_dim):
    """q [2, 4 heads, 37, 64] and a GQA k of 2 heads (or [B, S, H, D] with
    [S, 1, R/2] tables); a rotary fraction (32 or 24 of 64) leaves the rest
    as it was. Against the float64 reference, within twice torch's unfused
    error in the same dtype (one rounding against its three)."""
    S, D = 37, 64
    cos, sin = rope_tables(S, rot_dim)
    shape_q, shape_k = ((2, 4, S, D), (2, 2, S, D)) if layout == "bhsd" else ((2, S, 4, D), (2, S, 2, D))
    tables = (cos, sin) if layout == "bhsd" else (cos[:, None], sin[:, None])
    q, k = rnd(shape_q, dtype, 11, 2.0), rnd(shape_k, dtype, 12, 2.0)
    gq, gk = rnd(shape_q, dtype, 13), rnd(shape_k, dtype, 14)

    def run(impl):
        dt = torch.float64 if impl == "ref" else dtype
        qi, ki = leaf(q.to(dt)), leaf(k.to(dt))
        c, s = tables
        if impl == "ours":
            qo, ko = FF.apply_rotary(qi, ki, c.float(), s.float(), interleaved=interleaved)
        else:
            qo = rope_reference(qi, c.to(dt), s.to(dt), interleaved)
            ko = rope_reference(ki, c.to(dt), s.to(dt), interleaved)
        ((qo * gq.to(dt)).sum() + (ko * gk.to(dt)).sum()).backward()
        return qo.detach(), ko.detach(), qi.grad, ki.grad

    ours, theirs, ref = run("ours"), run("torch"), run("ref")
    names = ("q", "k", "grad q", "grad k")
    for name, o, t, r in zip(names, ours, theirs, ref):
        check(o, t, r, f"rotary {dtype} {layout} interleaved {interleaved} rot {rot_dim}: {name}")
    # The pass-through part is the input, bit for bit.
    assert torch.equal(ours[0][..., rot_dim:], q[..., rot_dim:])


def test_rotary_hf_tables_inplace_and_errors():
    S, D = 9, 16
    cos, sin = rope_tables(S, D)
    q, k = torch.randn(3, 2, S, D), torch.randn(3, 1, S, D)
    want_q, want_k = FF.apply_rotary(q, k, cos.float(), sin.float())
    # Hugging Face's [S, D] tables (angles over both halves) give the same.
    hf_q, hf_k = FF.apply_rotary(q, k, torch.cat([cos, cos], -1).float(), torch.cat([sin, sin], -1).float())
    assert torch.equal(hf_q, want_q) and torch.equal(hf_k, want_k)
    # In place, a non-contiguous view included.
    qi, kt = q.clone(), k.clone().transpose(1, 2)  # [3, S, 1, D] viewed from [3, 1, S, D]
    ki = kt.transpose(1, 2)
    out_q, out_k = FF.apply_rotary(qi, ki, cos.float(), sin.float(), inplace=True)
    assert out_q is qi and torch.equal(qi, want_q) and torch.equal(ki, want_k)
    # k may be absent.
    only_q, none = FF.apply_rotary(q, None, cos.float(), sin.float())
    assert none is None and torch.equal(only_q, want_q)
    with pytest.raises(RuntimeError, match="inplace=True is not differentiable"):
        FF.apply_rotary(q.requires_grad_(), None, cos.float(), sin.float(), inplace=True)
    with pytest.raises(RuntimeError, match="exceeds q's head_dim"):
        FF.apply_rotary(torch.randn(2, S, 12), None, cos.float(), sin.float())
    with pytest.raises(RuntimeError, match="do not broadcast"):
        FF.apply_rotary(torch.randn(2, S + 1, D), None, cos.float(), sin.float())


def test_rotary_compiles_fullgraph():
    cos, sin = rope_tables(12, 8)
    q, k = torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)

    def f(q, k):
        qo, ko = FF.apply_rotary(q, k, cos.float(), sin.float())
        return (qo * ko).sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        qi, ki = leaf(q), leaf(k)
        fn(qi, ki).backward()
        grads.append((qi.grad, ki.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# --------------------------------------------------------------- registration

FORWARD_OPS = {"layer_norm": "norm", "rms_norm": "norm", "bias_gelu": "activation",
               "swiglu": "activation", "rotary": "rotary"}
BACKWARD_OPS = ("layer_norm_backward", "rms_norm_backward", "bias_gelu_backward", "swiglu_backward")


def dispatch_rows(name):
    table = torch._C._dispatch_dump_table(f"fusetrain::{name}")
    return dict(line.split(": ", 1) for line in table.splitlines() if ": " in line)


@pytest.mark.parametrize("name", list(FORWARD_OPS) + list(BACKWARD_OPS) + ["rotary_"])
def test_every_backend_reaches_a_kernel(name):
    """CPU and Meta kernels of ours (CUDA too in a CUDA build), the ATen
    composition for every other backend (Note [Device-generic ops])."""
    from fusetrain import _C

    rows = dispatch_rows(name)
    for key in ("CPU", "Meta"):
        assert rows[key].endswith("[kernel]") and "generic" not in rows[key], (key, rows[key])
    if "CUDA" in rows:
        assert "cuda" in rows["CUDA"] or name.startswith("rotary"), rows["CUDA"]
    for key in ("PrivateUse1", "XPU", "MPS"):
        assert "generic_transformer.cpp" in rows[key], (key, rows[key])


@pytest.mark.parametrize("name", FORWARD_OPS)
def test_each_backward_is_registered_once_at_the_autograd_key(name):
    """Every backend's autograd runs the one Function of csrc/ops/autograd/
    (no Python twin); the backward ops themselves are not differentiable."""
    rows = dispatch_rows(name)
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradPrivateUse1"):
        assert f"autograd/{FORWARD_OPS[name]}.cpp" in rows[key], (key, rows[key])
    for backward in BACKWARD_OPS:
        assert "autograd/" not in dispatch_rows(backward).get("AutogradCPU", "")
