"""Torch fallback of widen+scatter, for torch tensors when CuPy cannot run.

Vectorised like the reference: the plan is expanded into row indices once,
then one ``index_select`` gathers the source rows, one cast widens them and
one ``index_copy_`` scatters them (plus one ``index_fill_`` for fill rows).
It works on CPU and CUDA tensors; on CUDA it costs an extra pass and a
temporary of the copied rows, which the CuPy kernel avoids.
"""

from __future__ import annotations

import contextlib

from gputq.errors import PlanError

from .plan import check_call, dtype_name, row_gather_indices

__all__ = ["torch_widen_scatter"]


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError("the torch widen+scatter fallback needs torch: pip install torch") from exc
    return torch


def _stream_context(torch, stream, device):
    if stream is None or device.type != "cuda":
        return contextlib.nullcontext()
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    handle = getattr(stream, "ptr", stream)  # a CuPy stream or a raw handle
    return torch.cuda.stream(torch.cuda.ExternalStream(int(handle), device=device))


def torch_widen_scatter(staging, plan, width, out, fill=0, *, validate=True, stream=None):
    """Widen and scatter rows of a torch ``staging`` tensor into ``out``.

    Parameters and semantics as :func:`kernels.widen_scatter`; ``staging``
    and ``out`` are torch tensors on one device (CPU or CUDA). ``stream`` (a
    torch or CuPy stream, or a raw handle) applies to CUDA tensors.

    Returns
    -------
    torch.Tensor
        ``out``, written in place.

    Raises
    ------
    PlanError
        On an invalid plan, dtypes, width or fill, tensors on different
        devices, or a non-contiguous ``out``.
    """
    torch = _import_torch()
    if not isinstance(staging, torch.Tensor) or not isinstance(out, torch.Tensor):
        raise PlanError("torch_widen_scatter takes torch tensors for staging and out")
    if staging.device != out.device:
        raise PlanError(f"staging is on {staging.device}, out on {out.device}")
    if not out.is_contiguous():
        raise PlanError("out must be contiguous")
    in_dtype = dtype_name(staging.dtype)
    plan, fill = check_call(
        in_dtype, staging.numel(), dtype_name(out.dtype), out.numel(), plan, width, fill, validate
    )
    src_idx, dst_idx, fill_idx = row_gather_indices(plan)
    device = out.device
    with _stream_context(torch, stream, device):
        out_rows = out.view(-1, width)
        if len(dst_idx):
            rows = staging.reshape(-1, width)
            if in_dtype == "uint16":
                # torch implements few kernels for uint16: gather the same
                # bits as int16 and undo the sign extension after widening.
                rows = rows.view(torch.int16)
            src_t = torch.from_numpy(src_idx).to(device)
            picked = rows.index_select(0, src_t).to(out.dtype)
            if in_dtype == "uint16":
                picked &= 0xFFFF
            out_rows.index_copy_(0, torch.from_numpy(dst_idx).to(device), picked)
        if len(fill_idx):
            out_rows.index_fill_(0, torch.from_numpy(fill_idx).to(device), fill.item())
    return out
