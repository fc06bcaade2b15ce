"""Model sources: the catalog of published configs, config.json files, nn.Module factories.

``load_workload(source)`` returns a :class:`Workload` whose ``build()`` makes the model (inside
whatever FakeTensorMode is active), ``make_batch(b)`` a synthetic batch and ``loss_fn`` the loss.
Importing this package does not import torch or transformers.
"""

from tilefit.models.catalog import catalog_names
from tilefit.models.sources import Workload, load_workload

__all__ = ["Workload", "catalog_names", "load_workload"]
