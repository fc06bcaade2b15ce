"""Devices: the catalog, lookup by name/alias/spec file/live GPU."""

from tilefit.hardware.device import Device
from tilefit.hardware.lookup import detect_live_device, get_device, list_devices, load_spec_file

__all__ = ["Device", "detect_live_device", "get_device", "list_devices", "load_spec_file"]
