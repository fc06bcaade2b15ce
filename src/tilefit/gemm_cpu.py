"""The GEMM cost model on a CPU (Device.kind == "cpu"); tilefit.gemm.analyze_gemm calls it.

GPU GEMMs are tiles spread over SMs in waves; a CPU BLAS (MKL, oneDNN, OpenBLAS) instead
packs blocks of A and B into contiguous buffers and streams them through a register-blocked
inner kernel on each core (Goto & van de Geijn, "Anatomy of High-Performance Matrix
Multiplication", ACM TOMS 34(3), 2008). Its time is modelled as

    t = overhead + (2MNK * s_flop + MK * s_a + KN * s_b + MN * s_c) / f_align

- overhead: the fixed cost of one call (dispatch, threading), measured with a 1x1x1 GEMM;
- s_flop: 1 / the inner kernel's FLOP/s, measured with a large GEMM;
- s_a, s_b: packing A and B, a read and a write of each element at the measured bandwidth;
- s_c: writing C once at the measured bandwidth;
- f_align: the speed factor (<= 1) when a dimension is off the device's multiple.

Small GEMMs are slower per FLOP because the overhead and the packing terms do not shrink with
the FLOPs: that is the model's small-dimension efficiency curve. Without a calibration
profile the coefficients come from the probe's measurements as above; `tilefit calibrate`
fits all five (and f_align) to measured GEMMs by weighted least squares.
"""

from __future__ import annotations

from tilefit.dtypes import DType
from tilefit.hardware.device import Device
from tilefit.hardware.profile import MODEL_CPU, GemmFit


def cpu_fit(device: Device, dt: DType) -> GemmFit:
    """The profile's fitted terms for ``dt``, or terms derived from the measured peak,
    bandwidth and overhead (module docstring)."""
    if device.profile is not None:
        fit = device.profile.fit_for(dt.name)
        if fit is not None and fit.model == MODEL_CPU:
            return fit
    bw = device.bandwidth_bytes_per_s * device.bandwidth_efficiency
    return GemmFit(
        dtype=dt.name,
        model=MODEL_CPU,
        call_overhead_s=device.launch_overhead_s,
        s_per_flop=1.0 / (device.peak(dt) * device.gemm_efficiency),
        s_per_a_element=2 * dt.bytes / bw,  # pack: read + write each element of A
        s_per_b_element=2 * dt.bytes / bw,  # pack: read + write each element of B
        s_per_c_element=dt.bytes / bw,  # write C once
        misaligned_factor=1.0,
    )
