"""GEMM dimensions off the device's multiple for their dtype, traced back to their origin.

The multiple is device.multiple(dtype) (16 bytes, 128 bytes on A100-class parts; NVIDIA's
Matrix Multiplication Background guide). Weight dimensions are fixed in the config or the layer;
token dimensions (batch x seq) by padding the batch. Each fix is re-estimated: weight dims by
rewriting the trace (whatif.rewrite_dim), token dims and hidden sizes by re-tracing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tilefit.advise.findings import MIN_RECOMMENDED_SPEEDUP, Change, Finding, severity_of
from tilefit.advise.origins import TOKEN, WEIGHT, Origin, config_fields, nearest_aligned
from tilefit.advise.whatif import WhatIf
from tilefit.errors import TilefitError
from tilefit.estimator import Estimate
from tilefit.estimator.result import OpCost
from tilefit.gemm import analyze_gemm, round_up

if TYPE_CHECKING:
    import torch.nn as nn

# a misaligned dimension whose GEMMs take less than this share of the step is not worth a
# finding (its fix cannot gain more than the share itself)
MIN_TIME_SHARE = 0.001
HEAD_DIM_MULTIPLE = 8


@dataclass
class _Hit:
    value: int
    multiple: int
    dtype: str
    ops: list[OpCost]


@dataclass(frozen=True)
class _DimFix:
    """The fix of one misaligned dimension, and the step re-estimated with it applied."""

    rule: str  # "sequence-length" or "weight-dim-alignment"
    dimension: str  # in the user's terms: "vocab_size", "batch x seq (8 x 1000)"
    current: int
    suggested: int
    fix: str
    after: Estimate
    method: str  # "retrace" or "rewrite"
    change: Change  # the fix as the combined prediction applies it


def misaligned_dims(estimate: Estimate) -> dict[int, _Hit]:
    """Dimension value -> the steady-step GEMM ops that have it off the multiple."""
    hits: dict[int, _Hit] = {}
    for c, g, dt in estimate.gemms():
        mult = estimate.device.multiple(dt)
        for value in {g.m, g.n, g.k}:
            if value % mult:
                hit = hits.setdefault(value, _Hit(value, mult, dt, []))
                hit.multiple = max(hit.multiple, mult)
                if c not in hit.ops:
                    hit.ops.append(c)
    return hits


def _factory_origin(whatif: WhatIf, value: int, ops: list[OpCost]) -> Origin:
    """For plain modules: the layer attribute (in_features, out_features, channels) holding it."""
    modules = module_map(whatif)
    for c in ops:
        mod = modules.get(c.record.module)
        for attr in ("out_features", "in_features", "out_channels", "in_channels",
                     "num_embeddings", "embedding_dim"):
            if getattr(mod, attr, None) == value:
                return Origin(WEIGHT, attr, value)
    return Origin(WEIGHT, "dimension", value)


def module_map(whatif: WhatIf) -> dict[str, nn.Module]:
    """WhatIf.named_modules, from the workload built on the meta device the first time."""
    if whatif.named_modules is None:
        whatif.named_modules = _meta_modules(whatif)
    return whatif.named_modules


def _meta_modules(whatif: WhatIf) -> dict[str, nn.Module]:
    work = whatif.workload
    if work is None:
        return {}
    import torch

    from tilefit.tracing.errors import USER_CODE_ERRORS

    try:
        with torch.device("meta"):
            model = work.build()
    except (TilefitError, *USER_CODE_ERRORS) as err:
        # the trace built it on fake tensors; on the meta device a factory may still fail (it
        # reads a tensor's value), or a transformers model without SDPA (traced with eager
        # attention): no layer names then, the rest of the finding stands
        whatif.skipped("weight-dim-alignment", "the layers holding each dimension (the model "
                       "built on the meta device)", err)
        return {}
    return dict(model.named_modules())


def origin_of(whatif: WhatIf, value: int, ops: list[OpCost]) -> Origin:
    work = whatif.workload
    batch_size = whatif.recipe.batch_size
    if work is not None and work.seq_len is not None:
        if value == batch_size * work.seq_len:
            return Origin(TOKEN, "batch x seq", value)
        if value == work.seq_len:
            return Origin(TOKEN, "seq", value)
    if work is not None and work.task == "image-cls" and value % batch_size == 0:
        return Origin(TOKEN, "batch x patches", value)  # ViT: (B x patches+1) rows
    if work is not None and work.config is not None:
        for origin in config_fields(work):
            if origin.value == value:
                return origin
        return Origin(WEIGHT, "dimension", value)
    return _factory_origin(whatif, value, ops)


def _modules(whatif: WhatIf, value: int, ops: list[OpCost], limit: int = 6) -> tuple[str, ...]:
    """The GEMMs' modules (slowest first), then other modules whose weights hold the value
    (a tied embedding)."""
    seen: list[str] = []
    for c in sorted(ops, key=lambda c: -c.time_s * c.repeats):
        module = c.record.module or "(loss, outside modules)"
        if module not in seen:
            seen.append(module)
    for r in whatif.trace.ops_of_step(1):
        if r.module and r.module not in seen and r.phase == "forward" and any(
                value in s for s in r.input_shapes):
            seen.append(r.module)
    return tuple(seen[:limit])


def _reason(whatif: WhatIf, hit: _Hit) -> str:
    by_phase: dict[str, float] = defaultdict(float)
    n_by_phase: dict[str, int] = defaultdict(int)
    for c in hit.ops:
        by_phase[c.record.phase] += c.time_s * c.repeats
        n_by_phase[c.record.phase] += 1
    top = max(hit.ops, key=lambda c: c.time_s)
    g = next(x for x in top.record.gemms if hit.value in (x.m, x.n, x.k))
    analysis = analyze_gemm(g.m, g.n, g.k, hit.dtype, whatif.device, batch=g.batch)
    phases = ", ".join(f"{n_by_phase[p]} in {p} ({by_phase[p] * 1e3:.2f} ms)"
                       for p in sorted(by_phase, key=lambda p: -by_phase[p]))
    total = sum(by_phase.values())
    device = whatif.device
    return (f"{hit.value} is not a multiple of {hit.multiple} ({hit.dtype} on "
            f"{device.name}: {device.alignment_bytes}-byte rule); {len(hit.ops)} GEMM op(s) "
            f"hold it: {phases}, {total / whatif.estimate.step_time_s:.1%} of the step. "
            f"The largest, {g.m}x{g.n}x{g.k} ({top.record.module or 'loss'}, "
            f"{top.record.phase}), is {analysis.bound}-bound at "
            f"{analysis.predicted_tflops:.0f} TFLOP/s (alignment factor "
            f"{analysis.alignment_efficiency:.2f}, tile efficiency "
            f"{analysis.tile_efficiency:.2f}, wave efficiency {analysis.wave_efficiency:.2f}).")


def _weight_fix(whatif: WhatIf, origin: Origin, new: int, mult: int) -> str:
    work = whatif.workload
    if origin.dimension == "vocab_size":
        tied = bool(work.config.get("tie_word_embeddings", True)) if work.config else False
        return (f"model.resize_token_embeddings({origin.value}, pad_to_multiple_of={mult}) "
                f"(gives {new}; from scratch: vocab_size={new} in the config). Token ids >= "
                f"{origin.value} are never produced by the tokenizer"
                + ("; the input embedding and the output head are tied, so this one change "
                   "pads both" if tied else ""))
    if origin.config_field is not None and work is not None and work.config is not None:
        from tilefit.models import hf

        key = hf.canonical_field(work.config, origin.config_field)
        if origin.dimension == "num_labels":
            extra = (f" and ignore logits {origin.value}..{new - 1} (e.g. mask them to -inf "
                     "before the loss)")
        else:
            extra = " (changes the architecture: for training from scratch, not for pretrained "\
                    "weights)"
        if origin.product:
            return (f"set {key}={origin.field_value(new)} in the config (was "
                    f"{origin.field_value(origin.value)}; {origin.dimension} = {new}){extra}")
        return f"set {key}={new} in the config (was {origin.value}){extra}"
    lines = _layer_lines(whatif, origin.value, new)
    if lines:
        return "; ".join(lines)
    return f"change the dimension {origin.value} to {new} in the layers listed"


def _layer_lines(whatif: WhatIf, old: int, new: int) -> list[str]:
    """The constructor line of every layer that holds ``old``, with ``new`` in its place:
    `0: nn.Linear(1000, 4032)`, `2: nn.Linear(4032, 1000)` (a hidden width changes in the
    layer that makes it and the one that takes it)."""
    import torch.nn as nn

    out = []
    for path, mod in module_map(whatif).items():
        if isinstance(mod, nn.Linear) and old in (mod.in_features, mod.out_features):
            in_dim = new if mod.in_features == old else mod.in_features
            out_dim = new if mod.out_features == old else mod.out_features
            bias = "" if mod.bias is not None else ", bias=False"
            out.append(f"{path or 'model'}: nn.Linear({in_dim}, {out_dim}{bias})")
        elif isinstance(mod, nn.Conv2d) and old in (mod.in_channels, mod.out_channels):
            in_dim = new if mod.in_channels == old else mod.in_channels
            out_dim = new if mod.out_channels == old else mod.out_channels
            out.append(f"{path or 'model'}: nn.Conv2d({in_dim}, {out_dim}, kernel_size="
                       f"{tuple(mod.kernel_size)}, ...)")
        elif isinstance(mod, nn.Embedding) and old in (mod.num_embeddings, mod.embedding_dim):
            rows = new if mod.num_embeddings == old else mod.num_embeddings
            dim = new if mod.embedding_dim == old else mod.embedding_dim
            out.append(f"{path or 'model'}: nn.Embedding({rows}, {dim})")
    return out


def _token_what_if(whatif: WhatIf, origin: Origin, hit: _Hit) -> _DimFix | None:
    """The sequence padded to the device's multiple (64 tokens for bf16 on A100-class parts,
    8 elsewhere), so batch x seq is aligned for any batch size, the last partial batch
    included; None where padding cannot fix it or the padded step cannot be re-traced."""
    work = whatif.workload
    if not whatif.can_retrace or work is None:
        return None  # an nn.Module: the audit's own note says re-traces were skipped
    if work.seq_len is None:
        whatif.skipped("sequence-length", f"{origin.dimension} = {hit.value} aligned",
                       "image patches: fixed by the image and patch size, not by padding")
        return None
    pad, seq = hit.multiple, work.seq_len
    new_seq = round_up(seq, pad)
    if new_seq == seq:
        return None
    # the padded length exceeds the model's positions: a note, no finding
    change = Change(seq_len=new_seq)
    after = whatif.try_apply("sequence-length", f"the step at sequence length {new_seq}",
                             change)
    if after is None:
        return None
    fix = (f"pad every batch to a multiple of {pad} tokens: DataCollatorWithPadding(tokenizer, "
           f"pad_to_multiple_of={pad}) (or tokenizer(..., padding='max_length', max_length="
           f"{new_seq})); the padding is masked out of the loss")
    dimension = ("seq" if origin.dimension == "seq" else
                 f"batch x seq ({whatif.recipe.batch_size} x {seq})")
    return _DimFix("sequence-length", dimension, seq, new_seq, fix, after, "retrace", change)


def _weight_what_if(whatif: WhatIf, origin: Origin, hit: _Hit) -> _DimFix | None:
    """The weight dimension at the nearest aligned value: hidden sizes and head dims
    re-traced (they change the attention), the others by rewriting the trace; None where the
    changed config cannot be re-traced."""
    new = nearest_aligned(hit.value, hit.multiple, origin.step)
    if origin.dimension == "head_dim":
        # the fused attention kernels want a head_dim multiple of 8 (flash: <= 256;
        # tracing/attention.py); that, not the GEMM multiple, decides the kernel
        new = nearest_aligned(hit.value, HEAD_DIM_MULTIPLE)
    if origin.dimension == "hidden_size" or origin.dimension.endswith("head_dim"):
        if not whatif.can_retrace or whatif.workload is None or origin.config_field is None:
            return None
        key, value = origin.config_field, origin.field_value(new)
        # (e.g. hidden not divisible by heads): a note, no finding
        after = whatif.try_apply("weight-dim-alignment", f"the step with {key}={value}",
                                 Change(config=((key, value),)))
        if after is None:
            return None
        method = "retrace"
    else:
        after, method = whatif.with_dim(hit.value, new), "rewrite"
    # combined with other fixes, the fix applies as it was predicted: a re-traced config
    # field in the config, a rewritten dimension rewritten in the combined step's traces (its
    # time as this finding's; its memory the step's before the change, as this finding's)
    change = (Change(config=((origin.config_field, origin.field_value(new)),))
              if method == "retrace" else Change(rewrite=((hit.value, new),)))
    return _DimFix("weight-dim-alignment", origin.dimension, hit.value, new,
                   _weight_fix(whatif, origin, new, hit.multiple), after, method, change)


def _finding(whatif: WhatIf, hit: _Hit, dim_fix: _DimFix) -> Finding:
    before = whatif.estimate
    after = dim_fix.after
    speedup = before.step_time_s / after.step_time_s
    recommended = speedup >= MIN_RECOMMENDED_SPEEDUP
    return Finding(
        rule=dim_fix.rule, severity=severity_of(speedup) if recommended else "info",
        title=f"{dim_fix.dimension} = {dim_fix.current} is off the multiple of {hit.multiple} "
        f"for {hit.dtype}",
        modules=_modules(whatif, hit.value, hit.ops), dimension=dim_fix.dimension,
        current=dim_fix.current, suggested=dim_fix.suggested, fix=dim_fix.fix,
        reason=_reason(whatif, hit)
        + ("" if recommended else f" Not recommended: the fix predicts {speedup:.3f}x "
           "(the padding costs more than the alignment gains)."),
        step_time_before_s=before.step_time_s, step_time_after_s=after.step_time_s,
        peak_memory_before_bytes=before.peak_memory_bytes,
        # a rewrite keeps the trace's storages: only a re-trace says what the memory becomes
        peak_memory_after_bytes=(after.peak_memory_bytes if dim_fix.method == "retrace"
                                 else before.peak_memory_bytes),
        method=dim_fix.method, recommended=recommended, change=dim_fix.change)


# fused projections whose GEMM dimension is a multiple of a config field: gate_up (2 x
# intermediate_size: Mixtral's and OLMoE's experts, Phi-3), qkv (3 x hidden_size)
FUSED_MULTIPLES = (2, 3)


def dimension_findings(whatif: WhatIf) -> list[Finding]:
    step = whatif.estimate.step_time_s
    found: list[Finding] = []
    # one row per sample (pooler, classifier) is the batch rules': not here
    hits = {value: hit for value, hit in misaligned_dims(whatif.estimate).items()
            if sum(c.time_s * c.repeats for c in hit.ops) / step >= MIN_TIME_SHARE
            and value != whatif.recipe.batch_size}
    origins = {value: origin_of(whatif, value, hit.ops) for value, hit in hits.items()}
    named = {v for v, o in origins.items() if o.config_field is not None}
    for value, hit in sorted(hits.items()):
        origin = origins[value]
        if origin.dimension == "dimension" and any(
                value == k * v for k in FUSED_MULTIPLES for v in named):
            continue  # a fused projection of a named field: that field's finding changes it
        what_if = _token_what_if if origin.kind == TOKEN else _weight_what_if
        dim_fix = what_if(whatif, origin, hit)
        if dim_fix is not None:
            found.append(_finding(whatif, hit, dim_fix))
    return found
