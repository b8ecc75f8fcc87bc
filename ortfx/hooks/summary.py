"""Tensor summaries: computed in buckets (exact counts, a std that is right for any mean),
written as one ``key: value`` line per statistic, and read back for comparison.

Pure functions over tensors and text; no files, no hooks.
"""

from __future__ import annotations

import ast
import math

import attrs
import torch

# 16 Mi elements: each bucket is copied to float64 once, so this bounds the extra memory at 128 MiB.
DEFAULT_BUCKET_SIZE = 1 << 24

FLOAT_FIELDS = ("min", "max", "mean", "std")
COUNT_FIELDS = ("nan", "inf", "neg", "pos", "zero")
# A summary ends with this line, so concatenated summaries stay readable in a diff.
SEPARATOR = "=" * 16


@attrs.frozen
class Summary:
    """The statistics of one tensor. ``std`` is the sample standard deviation (``torch.std``).

    NaN propagates as in torch: a tensor holding a NaN has NaN min, max, mean and std.
    An empty tensor has NaN statistics and zero counts; a one-element tensor has NaN std.
    """

    shape: tuple[int, ...]
    dtype: str
    numel: int
    min: float
    max: float
    mean: float
    std: float
    nan: int
    inf: int
    neg: int
    pos: int
    zero: int


def summarize(tensor: torch.Tensor, /, *, bucket_size: int = DEFAULT_BUCKET_SIZE) -> Summary:
    """Summarize ``tensor`` on its own device, ``bucket_size`` elements at a time.

    Each bucket contributes its count, mean and sum of squared deviations (in float64); they are
    combined exactly (Chan et al.), so the std is right whatever the mean, unlike a pooled
    per-bucket std. Complex tensors are summarized over their real and imaginary parts.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size}")
    shape, dtype = tuple(tensor.shape), str(tensor.dtype)
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    n = flat.numel()
    if n == 0:
        nan = math.nan
        return Summary(shape, dtype, 0, nan, nan, nan, nan, 0, 0, 0, 0, 0)
    rows = []
    for start in range(0, n, bucket_size):
        x = flat[start : start + bucket_size].to(torch.float64)
        bucket_mean = x.mean()
        rows.append(
            torch.stack(
                [
                    torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
                    bucket_mean,
                    ((x - bucket_mean) ** 2).sum(),
                    x.min(),
                    x.max(),
                    torch.isnan(x).sum(),
                    torch.isinf(x).sum(),
                    (x < 0).sum(),
                    (x > 0).sum(),
                    (x == 0).sum(),
                ]
            )
        )
    # One transfer to the host for the whole tensor.
    table = torch.stack(rows).cpu()
    counts, means, m2s = table[:, 0], table[:, 1], table[:, 2]
    mean = float((counts * means).sum() / n)
    m2 = float(m2s.sum() + (counts * (means - mean) ** 2).sum())
    std = math.sqrt(m2 / (n - 1)) if n > 1 and not math.isnan(m2) else math.nan
    if math.isnan(mean) or math.isinf(mean):
        std = math.nan  # torch.std of a tensor holding NaN or Inf
    low, high = table[:, 3], table[:, 4]
    return Summary(
        shape=shape,
        dtype=dtype,
        numel=n,
        min=float(low.min()),  # torch.min propagates NaN, as torch does on the whole tensor
        max=float(high.max()),
        mean=mean,
        std=std,
        nan=int(table[:, 5].sum()),
        inf=int(table[:, 6].sum()),
        neg=int(table[:, 7].sum()),
        pos=int(table[:, 8].sum()),
        zero=int(table[:, 9].sum()),
    )


def render(title: str, summary: Summary, /) -> str:
    """The text of one summary: a title line, one ``key: value`` line per field, a separator.

    Floats are written in full (Python's shortest round-trip form), so reading them back gives
    the same number.
    """
    lines = [title]
    for field in attrs.fields(Summary):
        value = getattr(summary, field.name)
        text = str(list(value)) if field.name == "shape" else str(value)
        lines.append(f"{field.name}: {text}")
    lines.append(SEPARATOR)
    return "\n".join(lines) + "\n"


def parse(text: str, /) -> Summary:
    """Read back what :func:`render` wrote (the title line is ignored)."""
    values: dict[str, str] = {}
    for line in text.splitlines()[1:]:
        if line == SEPARATOR:
            break
        key, sep, value = line.partition(": ")
        if sep:
            values[key] = value
    names = [f.name for f in attrs.fields(Summary)]
    missing = [k for k in names if k not in values]
    if missing:
        raise ValueError(f"not a summary written by ortfx.hooks: no {', '.join(missing)} line")
    floats = {k: float(values[k]) for k in FLOAT_FIELDS}
    counts = {k: int(values[k]) for k in COUNT_FIELDS}
    return Summary(
        shape=tuple(ast.literal_eval(values["shape"])),
        dtype=values["dtype"],
        numel=int(values["numel"]),
        min=floats["min"],
        max=floats["max"],
        mean=floats["mean"],
        std=floats["std"],
        nan=counts["nan"],
        inf=counts["inf"],
        neg=counts["neg"],
        pos=counts["pos"],
        zero=counts["zero"],
    )


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(a)


def differences(
    reference: Summary, other: Summary, /, *, rtol: float, atol: float
) -> tuple[str, ...]:
    """The fields where ``other`` differs from ``reference``.

    Shape, dtype and the NaN and Inf counts must be equal; min, max, mean and std must satisfy
    ``|other - reference| <= atol + rtol * |reference|`` (NaN equals NaN). The sign and zero
    counts are not compared: values within rounding of zero flip them without any divergence.
    """
    exact = ("shape", "dtype", "numel", "nan", "inf")
    found = [k for k in exact if getattr(reference, k) != getattr(other, k)]
    found += [
        k for k in FLOAT_FIELDS if not _close(getattr(reference, k), getattr(other, k), rtol, atol)
    ]
    return tuple(found)


def relative_difference(reference: Summary, other: Summary, /) -> float:
    """The largest relative difference over min, max, mean and std; ``inf`` when shape, dtype or
    the NaN/Inf counts differ, or one value is NaN/Inf and the other is not."""
    if any(getattr(reference, k) != getattr(other, k) for k in ("shape", "dtype", "nan", "inf")):
        return math.inf
    worst = 0.0
    for k in FLOAT_FIELDS:
        a, b = getattr(reference, k), getattr(other, k)
        if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
            if not _close(a, b, 0.0, 0.0):
                return math.inf
            continue
        scale = max(abs(a), abs(b))
        if scale > 0:
            worst = max(worst, abs(a - b) / scale)
    return worst
