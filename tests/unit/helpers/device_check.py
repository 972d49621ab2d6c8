"""A simulated accelerator for the CPU suite: tensors that report device `meta` and hold CPU data.

On a GPU, an op that meets a CUDA tensor and a CPU tensor fails, unless the CPU tensor is a
0-dim scalar, an index of advanced indexing, or the source or destination of a copy. A
tensor made without `device=` is a CPU tensor, so a factory call that forgot the device
crashes the first GPU run. PyTorch's `meta` device shows the same mistake without a GPU,
but holds no data: `.item()`, `.tolist()`, `nonzero` and every branch on a value fail
there. Under `simulated_device()`:

- `DEVICE` (meta) is the accelerator: a tensor moved or made there is an `OnDevice`
  wrapper, which reports `device.type == "meta"` (so code takes the branch a GPU takes,
  not its CPU kernels) and computes on a CPU tensor inside;
- every op that mixes an `OnDevice` tensor with a CPU tensor other than those CUDA allows
  raises `DeviceLeak`, naming the op and the CPU operand (a TorchDispatchMode sees every
  op: forward, backward, optimiser);
- reads of values (`.item()`, `.tolist()`, `float()`) work, as they do on CUDA, and
  `.numpy()` fails, as it does on CUDA;
- `torch.Generator(device=DEVICE)` is a CPU generator marked as the device's: random
  factories on the device need it, and refuse it for CPU tensors, as CUDA does.

Only the device bookkeeping is simulated: the numbers are the CPU's. Its rules are CUDA's
as far as a leak goes, with these limits: a CPU 0-dim tensor passes in every op (CUDA takes
it in elementwise ops); what CUDA refuses for other reasons (a dtype its kernels lack,
streams, `non_blocking`) is not checked; and torch skips work for meta parameters in a few
places (`load_state_dict` copies nothing into them: a checkpoint load must be checked by
its values, which torch.distributed.checkpoint writes in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# Index 1: the meta device of PyTorch's and transformers' lazy initialisation (no index)
# stays theirs.
DEVICE = torch.device("meta", 1)
aten = torch.ops.aten


class DeviceLeak(RuntimeError):
    """A CPU tensor met tensors on the (simulated) accelerator in one op."""


class OnDevice(torch.Tensor):
    """A tensor on the simulated accelerator: reports `DEVICE`, computes on `elem` (CPU)."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        # An inference tensor exactly where the CPU one is (a view of a normal tensor
        # made in inference mode is a normal tensor, and autograd checks that).
        with torch.inference_mode(elem.is_inference()):
            out = torch.Tensor._make_wrapper_subclass(
                cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
                dtype=elem.dtype, layout=elem.layout, device=DEVICE, requires_grad=False)
        out.elem = elem
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})

    def data_ptr(self) -> int:  # an address, as a CUDA tensor has one (identity keys use it)
        return self.elem.data_ptr()

    def tolist(self) -> Any:  # CUDA's copies to the CPU first; subclasses lack the C one
        return self.detach().cpu().tolist()

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"


class _DeviceGenerator(torch.Generator):
    """A generator of the simulated device (drawing on the CPU)."""


_Generator = torch.Generator


class _GeneratorType(type):
    """`torch.Generator` inside the block: `Generator(device=DEVICE)` is the device's."""

    def __call__(cls, device: Any = "cpu") -> torch.Generator:
        return _DeviceGenerator() if _is_device(device) else _Generator(device)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _Generator)


class _PatchedGenerator(metaclass=_GeneratorType):
    pass


def _is_device(device: Any) -> bool:
    return device is not None and torch.device(device) == DEVICE


# Ops that move data between devices: a CPU operand is their point.
_TRANSFERS = {aten._to_copy.default, aten.copy_.default, aten.copy.default,
              aten._copy_from.default, aten._copy_from_and_resize.default,
              aten.lift_fresh.default, aten.lift_fresh_copy.default,
              # `.to(...)` as inference mode dispatches it, undecomposed
              aten.to.device, aten.to.dtype_layout, aten.to.other}
# Advanced indexing: CUDA moves CPU index tensors itself (argument 1, a list of indices).
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._index_put_impl_.default, aten._unsafe_index.Tensor,
             aten._unsafe_index_put.default}


# Ops that read only the shape of their second tensor: it may be anywhere, and the result
# is where the first one is.
_SHAPE_OF_OTHER = {aten.expand_as.default, aten.view_as.default, aten.reshape_as.default,
                   aten.is_same_size.default, aten.resize_as_.default}


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"


def _check_mix(func, args: tuple, kwargs: dict, flat: list) -> None:
    if func in _TRANSFERS or func in _SHAPE_OF_OTHER:
        return
    exempt = set()
    if func in _INDEXING and len(args) > 1:
        exempt = {id(t) for t in args[1] if isinstance(t, torch.Tensor)}
    for t in flat:
        if (isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and t.dim() > 0
                and id(t) not in exempt):
            raise DeviceLeak(f"{func}: a CPU tensor ({_describe(t)}) meets tensors on the "
                             f"device; make it with device= of its inputs")


def _unwrap(x: Any) -> Any:
    if isinstance(x, OnDevice):
        return x.elem
    if isinstance(x, torch.Tensor) and x.is_meta:
        raise DeviceLeak(f"a meta tensor ({_describe(x)}, no data) meets tensors on the device")
    if isinstance(x, torch.device) and _is_device(x):
        return torch.device("cpu")
    return x


def _device_argument(func, args: tuple, kwargs: dict) -> Any:
    """The op's `device` argument, by keyword or by position (`aten.to.device`, which
    inference mode dispatches undecomposed, takes it second); None if it has none."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for i, arg in enumerate(func._schema.arguments[:len(args)]):
        if arg.name == "device":
            return args[i]
    return None


def _placed_on_device(func, args: tuple, kwargs: dict, flat: list) -> bool:
    """Whether the op's new tensors belong on the device (else on the CPU)."""
    device = _device_argument(func, args, kwargs)
    if device is not None:
        return _is_device(device)
    if func in _SHAPE_OF_OTHER:
        return isinstance(flat[0], OnDevice)
    return any(isinstance(t, OnDevice) for t in flat)


def _check_generator(func, args: tuple, kwargs: dict) -> None:
    """CUDA draws a device tensor's numbers from a CUDA generator only, and the reverse."""
    gen = kwargs.get("generator")
    if gen is None:
        return
    flat, _ = tree_flatten(args)
    if kwargs.get("device") is not None:
        on_device = _is_device(kwargs["device"])
    else:
        on_device = any(isinstance(t, OnDevice) for t in flat)
    if on_device != isinstance(gen, _DeviceGenerator):
        mine, theirs = ("device", "CPU") if on_device else ("CPU", "device")
        raise DeviceLeak(f"{getattr(func, '__name__', func)}: a generator of the {theirs} "
                         f"draws for a tensor on the {mine}")


def _aliased_argument(func, args: tuple, kwargs: dict, ret) -> Any:
    """The argument a mutable return aliases (in-place and out= ops return their input)."""
    alias = ret.alias_info
    if alias is None or not alias.is_write:
        return None
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            return args[i] if i < len(args) else kwargs.get(arg.name)
    return None


def _run(func, args: tuple, kwargs: dict) -> Any:
    flat, _ = tree_flatten((args, kwargs))
    on_device = _placed_on_device(func, args, kwargs, flat)
    mixed = any(isinstance(t, OnDevice) for t in flat)
    if not (on_device or mixed):
        return func(*args, **kwargs)  # the CPU's (or real meta tensors') own op
    if mixed:
        _check_mix(func, args, kwargs, flat)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    returns = func._schema.returns
    if not returns:
        return out
    if len(returns) == 1:
        return _wrap_return(func, args, kwargs, returns[0], out, on_device)
    return type(out)(_wrap_return(func, args, kwargs, r, o, on_device)
                     for r, o in zip(returns, out))


def _wrap_return(func, args: tuple, kwargs: dict, ret, out: Any, on_device: bool) -> Any:
    aliased = _aliased_argument(func, args, kwargs, ret)
    if aliased is not None:
        return aliased
    if not on_device:
        return out
    return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) else t, out)


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


# Factories that build a tensor from Python data below the dispatcher: made on the CPU,
# then moved (a copy the dispatch mode sees).
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


class _Factories(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_generator(func, args, kwargs)
        if func in _FROM_DATA and _is_device(kwargs.get("device")):
            return func(*args, **{**kwargs, "device": "cpu"}).to(DEVICE)
        if func is torch.Tensor.new_tensor and isinstance(args[0], OnDevice) and (
                kwargs.get("device") is None or _is_device(kwargs["device"])):
            made = func(args[0].elem, *args[1:], **{**kwargs, "device": "cpu"})
            return made.to(DEVICE)
        return func(*args, **kwargs)


def _with_device(listing: Any) -> Any:
    return lambda: [*listing(), DEVICE.type]


@contextlib.contextmanager
def _patched(*patches: tuple[Any, str, Any]) -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def simulated_device() -> Iterator[torch.device]:
    """Within the block, `DEVICE` is an accelerator whose leaks raise `DeviceLeak`.

    It is also one with torch's fused and foreach optimiser kernels, as CUDA is, so the
    optimiser takes CUDA's path (the kernels run on the CPU data)."""
    from torch.optim import optimizer, swa_utils
    from torch.utils import _foreach_utils as foreach

    fused = _with_device(foreach._get_fused_kernels_supported_devices)
    multi = _with_device(foreach._get_foreach_kernels_supported_devices)
    patches = [(torch, "Generator", _PatchedGenerator)]
    for module in (foreach, optimizer, swa_utils):
        if hasattr(module, "_get_fused_kernels_supported_devices"):
            patches.append((module, "_get_fused_kernels_supported_devices", fused))
        patches.append((module, "_get_foreach_kernels_supported_devices", multi))
    # `module.to(DEVICE)` swaps each parameter's contents (a CPU tensor cannot take an
    # OnDevice's with `.data =`), keeping the objects, so tied weights stay tied as a
    # move to CUDA keeps them.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with _patched(*patches), _Factories(), _Dispatch():
            yield DEVICE
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def is_on_device(t: torch.Tensor) -> bool:
    return isinstance(t, OnDevice)


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU data of a tensor on the simulated device (a CPU tensor as it is)."""
    return t.elem if isinstance(t, OnDevice) else t
