"""Argument checks shared by the kernel modules' Triton and torch entry points."""

from __future__ import annotations

import torch

from hicache.errors import InvalidArgument


def check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")


def check_out(out: torch.Tensor | None, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` if it is a contiguous ``dtype`` vector of ``size`` on ``device``; a new
    one when ``None``."""
    if out is None:
        return torch.empty(size, dtype=dtype, device=device)
    if out.dtype != dtype or out.shape != (size,) or out.device != device or not out.is_contiguous():
        name = str(dtype).removeprefix("torch.")
        raise InvalidArgument(
            f"out must be a contiguous {name} tensor of shape ({size},) on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out
