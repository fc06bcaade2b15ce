"""Your own training code on a simulated GPU (tilefit.simulation.session): ``simulate`` for
code in this process, ``run_script`` for a script or module (``tilefit run``)."""

from tilefit.simulation.session import DEFAULT_STEPS, Simulation, simulate

__all__ = ["DEFAULT_STEPS", "Simulation", "simulate"]
