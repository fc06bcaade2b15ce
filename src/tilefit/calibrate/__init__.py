"""Calibration: measure GEMMs and bandwidth on the live device, fit the cost model, store it."""
