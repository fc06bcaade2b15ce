"""Benchmarks on the live device: GEMM timing and the sweeps of NVIDIA's GEMM guides."""
