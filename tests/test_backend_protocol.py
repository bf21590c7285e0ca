"""Both backends implement one op set: the methods of base.Backend, with its parameter lists (CudaBackend read from
its source, since CI has no CuPy); and the numpy backend produces the deferred norm and refuses it where the CUDA
backend could not read it, so a model that misuses it fails on the CPU."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from cudflash.backends import base
from cudflash.backends.base import DEFERRED_READERS, Backend, DeferredNorm, backend_ops
from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.errors import BackendError

BACKENDS = Path(base.__file__).resolve().parent


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _signature(fn: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter after self; kind: positional, *args, keyword-only, **kwargs."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [(p.arg, "positional", d) for p, d in zip(positional, defaults)][1:]
    if a.vararg:
        out.append((a.vararg.arg, "*args", None))
    out += [(p.arg, "keyword-only", ast.unparse(d) if d is not None else None)
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", None))
    return out


def public_surface(path: Path, name: str) -> tuple[dict[str, list], set[str]]:
    """A class's public methods with their parameters, and the names its body assigns."""
    cls = _class(path, name)
    methods = {n.name: _signature(n) for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    assigned = {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assigned |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return methods, assigned


@pytest.mark.parametrize("module,cls", [("numpy_backend.py", "NumpyBackend"), ("cuda_backend.py", "CudaBackend")])
def test_each_backend_implements_the_protocol_and_nothing_beside_it(module, cls):
    protocol, attrs = public_surface(BACKENDS / "base.py", "Backend")
    assert list(protocol) == backend_ops() and {"name", "act_itemsize"} <= attrs
    methods, assigned = public_surface(BACKENDS / module, cls)
    assert set(methods) == set(protocol), (sorted(set(protocol) - set(methods)), sorted(set(methods) - set(protocol)))
    for op, params in protocol.items():
        assert methods[op] == params, op
    assert {"name", "act_itemsize"} <= assigned


def test_the_numpy_backend_object_keeps_the_protocol_signatures():
    """What the module defines is what callers get: the deferred-norm guard wraps the ops without changing them."""
    for op in backend_ops():
        want = [p.name for p in inspect.signature(getattr(Backend, op)).parameters.values()]
        assert [p.name for p in inspect.signature(getattr(NumpyBackend(), op)).parameters.values()] == want[1:], op


def _operands(rng: np.random.Generator):
    x, w = rng.standard_normal((3, 16), dtype=np.float32), rng.standard_normal((8, 16), dtype=np.float32)
    res, nw = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    return x, w, res, nw


def test_linear_and_swiglu_read_the_deferred_norm_as_the_plain_rows():
    b, rng = NumpyBackend(), np.random.default_rng(0)
    x, w, res, nw = _operands(rng)
    deferred, r = b.linear_add_rms_norm(x, w, None, res, nw, 1e-6)
    plain, r_plain = b.add_rms_norm(x @ w.T, res, nw, 1e-6)
    assert isinstance(deferred, DeferredNorm) and deferred.shape == (3, 8)
    np.testing.assert_array_equal(r, r_plain)
    w2 = rng.standard_normal((4, 8), dtype=np.float32)
    np.testing.assert_array_equal(b.linear(deferred, w2), b.linear(plain, w2))
    gate_up = b.gate_up_weight(w2, w2 + 1)
    np.testing.assert_array_equal(b.swiglu(deferred, gate_up), b.swiglu(plain, gate_up))


@pytest.mark.parametrize("op", [op for op in backend_ops() if op not in DEFERRED_READERS])
def test_every_other_op_refuses_the_deferred_norm(op):
    b = NumpyBackend()
    x, w, res, nw = _operands(np.random.default_rng(1))
    deferred, _ = b.linear_add_rms_norm(x, w, None, res, nw, 1e-6)
    params = list(inspect.signature(getattr(b, op)).parameters)
    for at in range(len(params)):  # the deferred rows in each argument position in turn, the rest placeholders
        args = [None] * len(params)
        args[at] = [deferred] if params[at] == "xs" else deferred
        with pytest.raises(BackendError, match=f"cpu backend: {op} was given the deferred normed rows"):
            getattr(b, op)(*args)


def test_a_model_that_misuses_the_deferred_norm_fails_on_the_cpu(tiny_pair, monkeypatch):
    """A target layer that adds to the normed rows (the CUDA backend's deferred form has no rows to add) is caught by
    the numpy backend, naming the op, rather than passing on the CPU and breaking on the GPU."""
    from cudflash import LLM, SamplingParams

    llm = LLM(tiny_pair / "target", backend="cpu")
    real = llm.backend.swiglu
    monkeypatch.setattr(llm.backend, "swiglu", lambda x, gate_up: real(llm.backend.add(x, x), gate_up))
    with pytest.raises(BackendError, match="add was given the deferred normed rows of linear_add_rms_norm"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
