"""`weightbus doctor`: what this host can do — the torch build, the optional packages, /dev/shm
against a model size, the privileges of the cluster bench, the transports and engines that work —
with the line that installs or enables each missing piece."""

from weightbus.apps.doctor.report import diagnose

__all__ = ["diagnose"]
